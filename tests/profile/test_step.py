"""A profiled training step: one row per layer in execution order, the bytes autograd saves, the
FLOPs torch counts, and a model left as it was found (no hooks)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from apr.config.schema import Architecture  # noqa: E402
from apr.model.llama import build_model  # noqa: E402
from apr.model.spec import block_param_specs  # noqa: E402
from apr.profile.step import profile_step  # noqa: E402

ARCH = Architecture.model_validate({
    "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64})


@pytest.fixture(scope="module")
def profiles():
    model = build_model(ARCH, seed=0)
    return {b: profile_step(model, batch_size=b, seq_len=16, steps=1) for b in (1, 2)}, model


def test_one_row_per_layer_in_execution_order_with_real_times(profiles):
    (by_batch, _) = profiles
    p = by_batch[1]
    assert [r.name for r in p.layers] == ["embed_tokens", "layers.0", "layers.1", "layers.2", "head+loss"]
    assert all(r.forward_s > 0 and r.backward_s > 0 for r in p.layers)
    assert p.optimizer_s > 0 and p.unprofiled_step_s > 0
    # the rows are parts of the profiled step, so they cannot add up to more than it
    assert sum(r.forward_s + r.backward_s for r in p.layers) + p.optimizer_s <= p.step_s


def test_saved_activations_are_per_layer_and_grow_with_the_batch(profiles):
    (by_batch, _) = profiles
    one, two = ({r.name: r.saved_bytes for r in by_batch[b].layers} for b in (1, 2))
    assert one["layers.1"] == one["layers.2"] > 0  # identical blocks save the same
    assert two["layers.2"] == 2 * one["layers.2"]  # activations, not weights: linear in the tokens
    weights = sum(p.numel() * 4 for p in build_model(ARCH, seed=0).model.layers[2].parameters())
    assert one["layers.2"] != weights


def test_counted_matmul_flops_are_six_per_parameter_per_token(profiles):
    (by_batch, _) = profiles
    p = by_batch[2]
    matrices = [s for s in block_param_specs(ARCH, 0) if len(s.shape) == 2]
    matmul_params = sum(s.numel for s in matrices) * ARCH.num_hidden_layers + ARCH.vocab_size * ARCH.hidden_size
    # the LM head's weight gradient is accumulated with addmm_, which torch's own table misses
    assert p.counted_by_op["mm"] + p.counted_by_op["addmm_"] == 6 * matmul_params * p.tokens
    assert any("scaled_dot_product" in op for op in p.counted_by_op)  # attention counted on the CPU too
    assert p.counted_flops == sum(p.counted_by_op.values())


def test_the_model_is_left_without_hooks(profiles):
    (_, model) = profiles
    for m in [model.model.embed_tokens, *model.model.layers]:
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks


def test_the_timed_step_takes_marks_only_and_memory_is_counted_on_a_step_of_its_own(profiles, monkeypatch):
    """The pack hook runs once per saved tensor: the steps the overhead is measured on do not run it."""
    from apr.profile.clock import Clock
    from apr.profile.step import _Recorder, _Step

    (_, model) = profiles
    packed = []
    step = _Step(model, 1, 16, "fp32")
    for memory in (False, True):
        rec = _Recorder(model, Clock(torch.device("cpu")), memory=memory)
        monkeypatch.setattr(rec, "pack",
                            lambda t, rec=rec, memory=memory: packed.append(memory) or _Recorder.pack(rec, t))
        step(rec)
        rec.remove()
        assert {name for name, _ in rec.marks} >= {"embed_tokens", "layers.0", "layers.2", "head+loss"}
        assert bool(rec.saved) == memory
    assert packed and all(packed)
