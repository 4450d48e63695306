"""Attention surgery: a student block initialised from a teacher block of another shape.

Upcycling (``training.mode: distill`` with a student whose attention differs from the teacher's)
starts each student block from the teacher block it maps to; these functions say how each
weight is carried over. Grouped-query conversion (fewer key/value heads than the teacher: MHA ->
GQA -> MQA) averages the teacher's key and value heads of each group, which is what a query head
of the group would see if the group's keys were one (Ainslie et al., 2023, "GQA", section 2.1).
See docs/design.md, "Upcycling into a new architecture".
"""

from __future__ import annotations

import torch

from apr.config.schema import Architecture
from apr.model import spec


class SurgeryError(ValueError):
    """A student block the teacher's block cannot initialise (the message says why)."""


def averaged_kv_heads(weight: torch.Tensor, teacher_kv: int, student_kv: int, head_dim: int) -> torch.Tensor:
    """``k_proj`` / ``v_proj`` weight ``[teacher_kv * head_dim, hidden]`` -> ``[student_kv * head_dim,
    hidden]``: student head ``g`` is the mean of teacher heads ``g * r .. g * r + r - 1``
    (``r = teacher_kv / student_kv``), the heads whose query heads student head ``g`` serves."""
    if teacher_kv % student_kv:
        raise SurgeryError(f"the student's {student_kv} key/value heads do not divide the teacher's {teacher_kv}: "
                           "each student head must average a whole group of teacher heads")
    r = teacher_kv // student_kv
    hidden = weight.shape[1]
    return weight.reshape(student_kv, r, head_dim, hidden).mean(dim=1).reshape(student_kv * head_dim, hidden)


@torch.no_grad()
def init_block(student_layer, teacher_layer, student: Architecture, teacher: Architecture) -> None:
    """Student decoder block from a teacher block: norms and MLP copied, query and output projections
    copied, key and value heads averaged per group (``averaged_kv_heads``)."""
    reasons = spec.student_init_problems(student, teacher)
    if reasons:
        raise SurgeryError("; ".join(r[1] for r in reasons))
    for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
        getattr(student_layer, name).load_state_dict(getattr(teacher_layer, name).state_dict())
    s, t = student_layer.self_attn, teacher_layer.self_attn
    s.q_proj.weight.copy_(t.q_proj.weight)
    s.o_proj.weight.copy_(t.o_proj.weight)
    for proj in ("k_proj", "v_proj"):
        w = getattr(t, proj).weight
        getattr(s, proj).weight.copy_(averaged_kv_heads(w, teacher.kv_heads, student.kv_heads, teacher.head_dim))
