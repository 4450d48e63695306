"""Attention surgery (apr/model/surgery.py): a student block of another attention shape started from a
teacher block, and the teacher/student pairs it refuses."""

from __future__ import annotations

import pytest
import torch

from apr.config.schema import Architecture
from apr.model import spec, surgery
from apr.model.llama import build_model

ARCH = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, vocab_size=50,
            max_position_embeddings=16)


def _block_out(model, x):
    cos, sin = model.rope(x.shape[1], x.device)
    return model.model.layers[0](x, cos, sin)


@pytest.mark.parametrize("student_kv", [2, 1])
def test_a_gqa_student_reproduces_a_teacher_whose_grouped_heads_are_equal(student_kv):
    """Averaging is exact when the heads of a group agree: the converted block's output is the
    teacher's, so averaging loses only what differs within a group."""
    teacher_arch = Architecture(**ARCH, num_key_value_heads=4)
    student_arch = Architecture(**ARCH, num_key_value_heads=student_kv)
    teacher, student = build_model(teacher_arch, 1), build_model(student_arch, 2)
    hd, r = teacher_arch.head_dim, 4 // student_kv
    with torch.no_grad():
        for proj in ("k_proj", "v_proj"):
            w = getattr(teacher.model.layers[0].self_attn, proj).weight
            heads = w.view(4, hd, -1)
            for g in range(student_kv):
                heads[g * r + 1:(g + 1) * r] = heads[g * r]  # every head of a group equal to its first
    surgery.init_block(student.model.layers[0], teacher.model.layers[0], student_arch, teacher_arch)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_block_out(student, x), _block_out(teacher, x), rtol=1e-5, atol=1e-6)


def test_each_student_kv_head_is_the_mean_of_its_group():
    w = torch.arange(4 * 2 * 3, dtype=torch.float32).view(8, 3)  # 4 heads of dim 2, hidden 3
    got = surgery.averaged_kv_heads(w, teacher_kv=4, student_kv=2, head_dim=2)
    torch.testing.assert_close(got[:2], (w[0:2] + w[2:4]) / 2)
    torch.testing.assert_close(got[2:], (w[4:6] + w[6:8]) / 2)
    with pytest.raises(surgery.SurgeryError, match="do not divide"):
        surgery.averaged_kv_heads(w, teacher_kv=4, student_kv=3, head_dim=2)


def test_students_the_teacher_cannot_start_name_the_key_that_differs():
    teacher = Architecture(**ARCH, num_key_value_heads=2)
    assert spec.student_init_problems(Architecture(**ARCH, num_key_value_heads=1), teacher) == []
    more = spec.student_init_problems(Architecture(**ARCH, num_key_value_heads=4), teacher)
    assert [p[0] for p in more] == ["num_key_value_heads"]
    heads = spec.student_init_problems(Architecture(**{**ARCH, "num_attention_heads": 2}), teacher)
    assert [p[0] for p in heads] == ["num_attention_heads"]


def test_a_gqa_student_holds_a_smaller_kv_cache_per_token():
    mha, mqa = Architecture(**ARCH), Architecture(**ARCH, num_key_value_heads=1)
    assert spec.kv_cache_bytes_per_token(mha, 4) == 2 * 1 * 4 * 8 * 4
    assert spec.kv_cache_bytes_per_token(mqa, 4) * 4 == spec.kv_cache_bytes_per_token(mha, 4)
