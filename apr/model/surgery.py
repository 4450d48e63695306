"""Attention surgery: a student block initialised from a teacher block of another shape.

Upcycling (``training.mode: distill`` with a student whose attention differs from the teacher's)
starts each student block from the teacher block it maps to; these functions say how each
weight is carried over. Grouped-query conversion (fewer key/value heads than the teacher: MHA ->
GQA -> MQA) averages the teacher's key and value heads of each group, which is what a query head
of the group would see if the group's keys were one (Ainslie et al., 2023, "GQA", section 2.1).
See docs/design.md, "Upcycling into a new architecture".
"""

from __future__ import annotations

import copy
import math

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


def kept_neurons(mlp, width: int) -> torch.Tensor:
    """The ``width`` SwiGLU neurons of a teacher MLP a narrower student keeps, in their order: those of
    the largest ``|gate_n| |up_n| |down_n|`` (a bound on what neuron ``n`` can add to the output for
    a unit input), all of them when the widths agree."""
    inter = mlp.down_proj.weight.shape[1]
    if width >= inter:
        return torch.arange(inter)
    score = (mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1) * mlp.down_proj.weight.norm(dim=0))
    return score.topk(width).indices.sort().values


def geo_rows(head_dim: int, geo_dim: int) -> tuple[list[int], list[int]]:
    """A head's rows RoPE turns fastest (the first ``geo_dim / 2`` of each half: HF's layout pairs
    row ``i`` with ``i + head_dim / 2`` at frequency ``theta^(-2i / head_dim)``), and the rest."""
    half, g = head_dim // 2, geo_dim // 2
    geo = [*range(g), *range(half, half + g)]
    return geo, [i for i in range(head_dim) if i not in set(geo)]


def decoupled_from(q_w: torch.Tensor, k_w: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, sem_dim: int,
                   geo_dim: int) -> dict[str, torch.Tensor]:
    """Decoupled attention's four query/key projections from a standard head's ``q_proj`` /
    ``k_proj`` (``k_w`` already at the student's key/value heads).

    Geometric part: the rows RoPE turns fastest (``geo_rows``), copied, turned at the same
    frequencies by the student's RoPE (``spec.rope_base``). Semantic part: the rest of the head
    turns slowly (the least a token apart: ``theta^(-(geo_dim)/head_dim)`` radians); read as
    position-free, its score is the bilinear form ``x^T M_q y`` with ``M_q = Wq_rest_q^T Wk_rest``.
    The best rank-``sem_dim`` form whose key side is shared by the query heads of a key head is
    the truncated SVD of their stacked ``M_q``: keys ``sqrt(S) V^T``, queries ``S^(-1/2) V^T M_q^T``
    (for one query head per key head, exactly the truncated SVD of ``W_q W_k^T`` restricted to
    those rows). docs/design.md, "Upcycling into a new architecture"."""
    h = q_w.shape[1]
    geo, rest = geo_rows(head_dim, geo_dim)
    q = q_w.float().view(n_heads, head_dim, h)
    k = k_w.float().view(n_kv, head_dim, h)
    r = n_heads // n_kv
    q_sem, k_sem = [], []
    for j in range(n_kv):
        b = k[j, rest]  # [m, h]
        qb, rb = torch.linalg.qr(b.T)  # b = rb^T qb^T; the key side lives in b's row space
        stacked = torch.cat([q[i, rest].T @ rb.T for i in range(j * r, (j + 1) * r)])  # [r h, m]
        _, sv, wt = torch.linalg.svd(stacked, full_matrices=False)
        v = (qb @ wt.T)[:, :sem_dim]  # [h, sem]
        root = sv[:sem_dim].clamp_min(sv[0] * 1e-12 + 1e-30).sqrt()
        k_sem.append(root[:, None] * v.T)
        bv = b @ v  # [m, sem]
        q_sem += [((q[i, rest].T @ bv) / root).T for i in range(j * r, (j + 1) * r)]
    return {"q_sem_proj": torch.cat(q_sem), "k_sem_proj": torch.cat(k_sem),
            "q_geo_proj": q[:, geo].reshape(-1, h), "k_geo_proj": k[:, geo].reshape(-1, h)}


@torch.no_grad()
def init_block(student_layer, teacher_layer, student: Architecture, teacher: Architecture) -> None:
    """Student decoder block from a teacher block: norms and MLP copied, query and output projections
    copied, key and value heads averaged per group (``averaged_kv_heads``); a decoupled student's
    query/key parts from the teacher's by ``decoupled_from``."""
    reasons = spec.student_init_problems(student, teacher)
    if reasons:
        raise SurgeryError("; ".join(r[1] for r in reasons))
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(student_layer, name).load_state_dict(getattr(teacher_layer, name).state_dict())
    keep = kept_neurons(teacher_layer.mlp, student.intermediate_size)
    sm, tm = student_layer.mlp, teacher_layer.mlp
    sm.gate_proj.weight.copy_(tm.gate_proj.weight[keep])
    sm.up_proj.weight.copy_(tm.up_proj.weight[keep])
    sm.down_proj.weight.copy_(tm.down_proj.weight[:, keep])
    s, t = student_layer.self_attn, teacher_layer.self_attn
    s.o_proj.weight.copy_(t.o_proj.weight)
    s.v_proj.weight.copy_(averaged_kv_heads(t.v_proj.weight, teacher.kv_heads, student.kv_heads, teacher.head_dim))
    if teacher.decoupled_attention is not None:  # the same decoupled attention (student_init_problems)
        for proj in ("q_sem_proj", "k_sem_proj", "q_geo_proj", "k_geo_proj"):
            w = getattr(t, proj).weight
            if proj.startswith("k_"):
                dim = getattr(teacher.decoupled_attention, proj[2:5] + "_dim")
                w = averaged_kv_heads(w, teacher.kv_heads, student.kv_heads, dim)
            getattr(s, proj).weight.copy_(w)
        return
    k_w = averaged_kv_heads(t.k_proj.weight, teacher.kv_heads, student.kv_heads, teacher.head_dim)
    d = student.decoupled_attention
    if d is None:
        s.q_proj.weight.copy_(t.q_proj.weight)
        s.k_proj.weight.copy_(k_w)
        return
    parts = decoupled_from(t.q_proj.weight, k_w, student.num_attention_heads, student.kv_heads, student.head_dim,
                           d.sem_dim, d.geo_dim)
    for proj, w in parts.items():
        getattr(s, proj).weight.copy_(w)


# ---------------------------------------------------------------------------- a narrower hidden size


def hidden_basis(embed: torch.Tensor, width: int) -> torch.Tensor:
    """``[teacher hidden, width]``: the top ``width`` right singular directions of the teacher's
    embedding matrix (a truncated SVD, uncentred), the student's hidden coordinates inside the
    teacher's; the embedding keeps the most energy any ``width``-dimensional subspace can."""
    _, _, vh = torch.linalg.svd(embed.detach().float(), full_matrices=False)
    return vh[:width].T.contiguous()


def kept_rope_rows(head_dim: int, student_head_dim: int) -> list[int]:
    """A teacher head's rows a narrower head keeps: every ``k``-th RoPE pair (``k = head_dim /
    student_head_dim``), each half's in HF's layout; student pair ``j`` turns at ``theta^(-2j /
    student_head_dim)``, the frequency of teacher pair ``k j``, so the kept rows keep their rotation."""
    k, half = head_dim // student_head_dim, head_dim // 2
    first = list(range(0, half, k))
    return first + [half + i for i in first]


def _linear(module, weight: torch.Tensor) -> None:
    module.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)


@torch.no_grad()
def narrowed_layer(teacher_layer, teacher: Architecture, basis: torch.Tensor):
    """A copy of a teacher block at the student's hidden size ``basis.shape[1]`` (same heads, so a
    narrower head_dim), for ``init_block`` (docs/design.md, "Upcycling into a new architecture"):

    - reads: each input-side weight ``W`` (q, k, v, gate, up) becomes ``W diag(g) basis``, the
      RMSNorm weight ``g`` before it folded in; the norms become ``sqrt(teacher / student hidden)``
      (the projected state keeps ~its norm over fewer coordinates, so its RMS grows by that factor);
    - writes: ``o_proj`` and ``down_proj`` become ``basis^T W``;
    - query/key rows: every ``k``-th RoPE pair (``kept_rope_rows``: same frequencies), queries
      scaled by ``sqrt(k)`` (the kept pairs carry ~1/k of the score, the softmax scale grows by
      sqrt(k));
    - values and outputs: per key/value head, the best rank-``student head_dim`` factorisation of
      its query heads' stacked ``O_h V`` (truncated SVD, square root of the singular values to each
      side)."""
    t_hidden, s_hidden = basis.shape
    heads, kv, hd = teacher.num_attention_heads, teacher.kv_heads, teacher.head_dim
    s_hd = s_hidden // heads
    out = copy.deepcopy(teacher_layer)
    a = out.self_attn
    g_in, g_post = out.input_layernorm.weight.float(), out.post_attention_layernorm.weight.float()
    scale = math.sqrt(t_hidden / s_hidden)
    for norm in (out.input_layernorm, out.post_attention_layernorm):
        norm.weight = torch.nn.Parameter(torch.full((s_hidden,), scale), requires_grad=False)
    rows = kept_rope_rows(hd, s_hd)
    k_ratio = hd // s_hd
    q = (a.q_proj.weight.float() * g_in) @ basis
    k = (a.k_proj.weight.float() * g_in) @ basis
    _linear(a.q_proj, q.view(heads, hd, s_hidden)[:, rows].reshape(-1, s_hidden) * math.sqrt(k_ratio))
    _linear(a.k_proj, k.view(kv, hd, s_hidden)[:, rows].reshape(-1, s_hidden))
    v = ((a.v_proj.weight.float() * g_in) @ basis).view(kv, hd, s_hidden)
    o = (basis.T @ a.o_proj.weight.float()).view(s_hidden, heads, hd)
    r = heads // kv
    v_new, o_new = [], [None] * heads
    for j in range(kv):
        stacked = torch.cat([o[:, h] for h in range(j * r, (j + 1) * r)])  # [r s_hidden, hd]
        u, sv, vt = torch.linalg.svd(stacked @ v[j], full_matrices=False)
        root = sv[:s_hd].sqrt()
        v_new.append(root[:, None] * vt[:s_hd])
        left = u[:, :s_hd] * root
        for n, h in enumerate(range(j * r, (j + 1) * r)):
            o_new[h] = left[n * s_hidden:(n + 1) * s_hidden]
    _linear(a.v_proj, torch.cat(v_new))
    _linear(a.o_proj, torch.cat(o_new, dim=1))
    m = out.mlp
    _linear(m.gate_proj, (m.gate_proj.weight.float() * g_post) @ basis)
    _linear(m.up_proj, (m.up_proj.weight.float() * g_post) @ basis)
    _linear(m.down_proj, basis.T @ m.down_proj.weight.float())
    return out


@torch.no_grad()
def init_narrower_student(student, teacher) -> torch.Tensor:
    """A student of smaller ``hidden_size`` from its teacher, blocks 1:1 by ``spans`` starts
    (``init_narrower_blocks``); embedding ``E basis``, head ``W diag(g_final) basis`` (a tied head:
    the final norm keeps ``diag(basis^T diag(g) basis)``). Returns the basis."""
    s_arch, t_arch = student.arch, teacher.arch
    basis = hidden_basis(teacher.model.embed_tokens.weight, s_arch.hidden_size).to(
        teacher.model.embed_tokens.weight.device)
    scale = math.sqrt(t_arch.hidden_size / s_arch.hidden_size)
    g = teacher.model.norm.weight.float()
    student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight.float() @ basis)
    if student.lm_head is not None:
        student.model.norm.weight.fill_(scale)
        student.lm_head.weight.copy_((teacher.head_weight.float() * g) @ basis)
    else:
        student.model.norm.weight.copy_(scale * (basis * basis * g[:, None]).sum(0))
    return basis


def narrowed_arch(teacher: Architecture, hidden: int) -> Architecture:
    """The teacher's architecture at the student's hidden size (``narrowed_layer``'s shapes)."""
    return teacher.model_copy(update={"hidden_size": hidden})
