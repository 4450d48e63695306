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
    # a Qwen2 teacher's q/k/v biases are not carried over; a student needs its teacher's RoPE scaling
    qwen = spec.student_init_problems(teacher, Architecture(**ARCH, num_key_value_heads=2, family="qwen2"))
    assert [p[0] for p in qwen] == ["family"] and "qwen2" in qwen[0][3]
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaled = Architecture(**ARCH, num_key_value_heads=2, rope_scaling=llama3)
    assert [p[0] for p in spec.student_init_problems(teacher, scaled)] == ["rope_scaling"]
    assert spec.student_init_problems(scaled, scaled) == []
    narrow = Architecture(**{**ARCH, "hidden_size": 16}, num_key_value_heads=2, rope_scaling=llama3)
    assert [p[0] for p in spec.student_init_problems(narrow, scaled)] == ["rope_scaling"]


def test_a_gqa_student_holds_a_smaller_kv_cache_per_token():
    mha, mqa = Architecture(**ARCH), Architecture(**ARCH, num_key_value_heads=1)
    assert spec.kv_cache_bytes_per_token(mha, 4) == 2 * 1 * 4 * 8 * 4
    assert spec.kv_cache_bytes_per_token(mqa, 4) * 4 == spec.kv_cache_bytes_per_token(mha, 4)


def _attention_out(model, x):
    layer = model.model.layers[0]
    cos, sin = model.rope(x.shape[1], x.device)
    return layer.self_attn(layer.input_layernorm(x), cos, sin)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8}])
def test_a_full_width_decoupled_student_reproduces_its_teachers_attention(scaling):
    """sem_dim + geo_dim = head_dim: the geometric part is the teacher's fastest RoPE rows turned at
    the same frequencies (a Llama-3 teacher's: scaled), the semantic part the rest's exact
    factorisation; what differs is only the slow rows' rotation, negligible at rope_theta 1e6 over 8
    positions."""
    teacher_arch = Architecture(**ARCH, num_key_value_heads=2, rope_theta=1e6, rope_scaling=scaling)
    student_arch = Architecture(**ARCH, num_key_value_heads=2, rope_theta=1e6, rope_scaling=scaling,
                                decoupled_attention={"sem_dim": 4, "geo_dim": 4})
    teacher, student = build_model(teacher_arch, 1), build_model(student_arch, 2)
    assert [p.name for p in spec.param_specs(student_arch)] == [n for n, _ in student.named_parameters()]
    surgery.init_block(student.model.layers[0], teacher.model.layers[0], student_arch, teacher_arch)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    want = _attention_out(teacher, x)
    torch.testing.assert_close(_attention_out(student, x), want, rtol=0, atol=1e-4 * want.abs().max().item())


def test_the_semantic_part_is_the_truncated_svd_of_each_heads_position_free_form():
    hd, geo, sem = 8, 2, 3
    q_w = torch.randn(4 * hd, 32, generator=torch.Generator().manual_seed(6))
    k_w = torch.randn(4 * hd, 32, generator=torch.Generator().manual_seed(7))
    parts = surgery.decoupled_from(q_w, k_w, 4, 4, hd, sem, geo)
    _, rest = surgery.geo_rows(hd, geo)
    for head in range(4):
        m = q_w.view(4, hd, 32)[head, rest].T @ k_w.view(4, hd, 32)[head, rest]
        u, s, vt = torch.linalg.svd(m)
        best = u[:, :sem] @ torch.diag(s[:sem]) @ vt[:sem]
        got = parts["q_sem_proj"][head * sem:(head + 1) * sem].T @ parts["k_sem_proj"][head * sem:(head + 1) * sem]
        torch.testing.assert_close(got, best, rtol=1e-4, atol=1e-4 * best.abs().max().item())
    geo_idx, _ = surgery.geo_rows(hd, geo)
    assert geo_idx == [0, 4]  # the fastest pair: row 0 turns with row head_dim / 2
    torch.testing.assert_close(parts["q_geo_proj"][:geo], q_w[geo_idx])


def test_decoupled_attention_wider_than_a_head_or_with_an_odd_rope_part_is_refused():
    for bad, says in (({"sem_dim": 6, "geo_dim": 4}, "more than head_dim 8"), ({"sem_dim": 2, "geo_dim": 3}, "even")):
        with pytest.raises(ValueError, match=says):
            Architecture(**ARCH, decoupled_attention=bad)
    small = Architecture(**ARCH, decoupled_attention={"sem_dim": 2, "geo_dim": 2})
    assert spec.kv_cache_bytes_per_token(small, 4) == 4 * (4 + 8) * 4  # keys 4 wide, values 8


def test_a_narrower_mlp_keeps_the_teachers_neurons_that_matter():
    """A student MLP of 32 neurons from a teacher's 48 of which 16 contribute nothing (zero output
    weights): the kept neurons are the 32 live ones, so the block is reproduced exactly."""
    teacher_arch = Architecture(**ARCH, num_key_value_heads=2)
    student_arch = Architecture(**{**ARCH, "intermediate_size": 32}, num_key_value_heads=2)
    teacher, student = build_model(teacher_arch, 1), build_model(student_arch, 2)
    dead = torch.arange(0, 48, 3)  # every third neuron
    with torch.no_grad():
        teacher.model.layers[0].mlp.down_proj.weight[:, dead] = 0.0
    surgery.init_block(student.model.layers[0], teacher.model.layers[0], student_arch, teacher_arch)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(_block_out(student, x), _block_out(teacher, x), rtol=1e-5, atol=1e-6)
    wider = Architecture(**{**ARCH, "intermediate_size": 64}, num_key_value_heads=2)
    assert [p[0] for p in spec.student_init_problems(wider, teacher_arch)] == ["intermediate_size"]


def _subspace_teacher(blocks_write: bool):
    """A 2-block teacher (hidden 32) whose embedding spans 12 directions; its blocks write inside
    that span (``blocks_write``) or nothing at all (their output projections zero)."""
    arch = Architecture(**{**ARCH, "num_hidden_layers": 2, "vocab_size": 50})
    t = build_model(arch, 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        t.model.embed_tokens.weight.copy_(torch.randn(50, 12, generator=g) @ torch.randn(12, 32, generator=g) * 0.3)
        t.lm_head.weight.mul_(50)
        _, _, vh = torch.linalg.svd(t.model.embed_tokens.weight)
        span = vh[:12].T @ vh[:12]
        for layer in t.model.layers:
            for out in (layer.self_attn.o_proj, layer.mlp.down_proj):
                out.weight.copy_(span @ out.weight * 5 if blocks_write else torch.zeros_like(out.weight))
            for w in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
                      layer.mlp.up_proj):
                w.weight.mul_(5)
    return t


def _kl(student, teacher, ids) -> float:
    with torch.no_grad():
        s, t = torch.log_softmax(student(ids), -1), torch.log_softmax(teacher(ids), -1)
    return torch.nn.functional.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean").item()


def test_a_narrower_student_keeps_what_the_teachers_embedding_directions_carry():
    """Half the teacher's hidden size (32 -> 16, head_dim 8 -> 4): exact where the teacher's states
    live in the embedding's top directions and its blocks write nothing; where its blocks write inside
    those directions, the student's logits are far closer to the teacher's than a random student's
    (only the dropped RoPE pairs and the truncated value/output ranks are lost)."""
    from apr.train.distill import init_student_from_teacher

    narrow = Architecture(**{**ARCH, "num_hidden_layers": 2, "vocab_size": 50, "hidden_size": 16})
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    for blocks_write in (False, True):
        teacher, student, cold = _subspace_teacher(blocks_write), build_model(narrow, 2), build_model(narrow, 3)
        init_student_from_teacher(student, teacher, [(0, 1), (1, 2)])
        warm = _kl(student, teacher, ids)
        assert warm < (1e-6 if not blocks_write else 0.02 * _kl(cold, teacher, ids)), warm
    assert surgery.kept_rope_rows(8, 4) == [0, 2, 4, 6]  # pairs 0 and 2 of 4: frequencies theta^(-2j/4)


def test_a_narrower_student_needs_an_even_head_dim_that_divides_the_teachers():
    teacher = Architecture(**ARCH)  # head_dim 8
    assert not spec.student_init_problems(Architecture(**{**ARCH, "hidden_size": 16}), teacher)
    for hidden, key in ((24, "hidden_size"), (48, "hidden_size"), (4, "hidden_size")):  # 6 / wider / 1
        problems = spec.student_init_problems(Architecture(**{**ARCH, "hidden_size": hidden}), teacher)
        assert [p[0] for p in problems] == [key], (hidden, problems)
