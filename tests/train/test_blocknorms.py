"""apr/train/blocknorms.py: per-group gradient and update norms against the real ones."""

from __future__ import annotations

import math

import pytest
import torch

from apr.steps.resolved import resolve as plan_of
from apr.train import blocknorms
from apr.train.blocknorms import adamw_update_sq_norm, block_metrics
from apr.train.build import build_engine
from tests.train.tiny import batches, make_config


def _group_weights(engine) -> dict[str, list[torch.Tensor]]:
    if engine.kind == "standard":
        return {name: [p.detach().clone() for p in params] for name, params in engine.gradients.groups}
    return {g.name: [g.flat_params.clone()] for g in engine.gradients.groups}


def _real_norms(before: dict, after: dict) -> dict[str, float]:
    return {name: math.sqrt(sum(((a - b).double() ** 2).sum().item() for a, b in zip(after[name], before[name],
                                                                                     strict=True)))
            for name in before}


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_norms_equal_the_real_differences_of_a_cloned_copy(engine_kind):
    config = make_config(training={"engine": engine_kind})
    engine = build_engine(plan_of(config))
    data = batches(config, 3)
    lr = 3e-2
    for k in range(2):  # moments with history, then the step measured
        engine.train_step([data[k]], lr=lr)
    before = _group_weights(engine)
    engine.train_step([data[2]], lr=lr)
    real = _real_norms(before, _group_weights(engine))

    got = block_metrics(engine, lr)

    n = config.model.architecture.num_hidden_layers
    assert len(got["block_update_norm"]) == len(got["block_grad_norm"]) == n
    assert got["block_update_norm"] == pytest.approx([real[f"block.{i}"] for i in range(n)], rel=1e-4)
    assert got["embed_update_norm"] == pytest.approx(real["embed"], rel=1e-4)
    assert got["head_update_norm"] == pytest.approx(real["head"], rel=1e-4)
    assert got["max_block_update_norm"] == max(got["block_update_norm"])
    assert min(real.values()) > 0  # every group moved: the comparison is not 0 == 0


def test_grad_norms_are_each_groups_gradient_norm_in_both_engines():
    # no clipping: the standard engine's .grad after the step is the raw gradient
    std_config = make_config(training={"engine": "standard", "grad_clip": None})
    std = build_engine(plan_of(std_config))
    data = batches(std_config, 1)
    std.train_step(data, lr=1e-2)
    want = {name: math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))
            for name, params in std.gradients.groups}
    inter = build_engine(plan_of(make_config(training={"grad_clip": None})))
    inter.train_step(data, lr=1e-2)
    for engine in (std, inter):
        got = block_metrics(engine, 1e-2)
        assert got["block_grad_norm"] == pytest.approx([want[f"block.{i}"] for i in range(3)], rel=1e-5)
        assert got["embed_grad_norm"] == pytest.approx(want["embed"], rel=1e-5)
        assert got["head_grad_norm"] == pytest.approx(want["head"], rel=1e-5)
        assert got["max_block_grad_norm"] == max(got["block_grad_norm"])


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_a_step_that_applied_no_update_has_update_norm_zero(engine_kind):
    config = make_config(training={"engine": engine_kind, "mixed_precision": "fp16"})
    engine = build_engine(plan_of(config))
    data = batches(config, 2)
    engine.train_step([data[0]], lr=1e-2)
    assert block_metrics(engine, 1e-2)["max_block_update_norm"] > 0
    engine.scaler.scale = 2.0 ** 120  # the scaled gradients overflow: an fp16 skipped step
    before = _group_weights(engine)
    result = engine.train_step([data[1]], lr=1e-2)
    assert result.skipped and max(_real_norms(before, _group_weights(engine)).values()) == 0.0
    got = block_metrics(engine, 1e-2)
    assert got["block_update_norm"] == [0.0] * 3 and got["embed_update_norm"] == 0.0 and got["head_update_norm"] == 0.0
    assert got["block_grad_norm"] == [None] * 3  # the overflowed gradient's norm is not finite


def test_fp16_grad_norms_are_unscaled():
    config = make_config(training={"mixed_precision": "fp16", "grad_clip": None})
    engine = build_engine(plan_of(config))
    data = batches(config, 1)
    engine.train_step(data, lr=1e-2)
    assert engine.group_sq_scale == 65536.0
    fp32 = build_engine(plan_of(make_config(training={"grad_clip": None})))
    fp32.train_step(data, lr=1e-2)
    got, want = block_metrics(engine, 1e-2), block_metrics(fp32, 1e-2)
    assert got["block_grad_norm"] == pytest.approx(want["block_grad_norm"], rel=2e-2)  # fp16 autocast vs fp32


def test_nothing_before_the_first_step():
    assert block_metrics(build_engine(plan_of(make_config())), 1e-3) == {}


def test_chunks_and_decay_ranges_match_the_direct_formula(monkeypatch):
    monkeypatch.setattr(blocknorms, "CHUNK_CPU", 7)  # many chunks, some straddling the range edges
    gen = torch.Generator().manual_seed(0)
    w, m = torch.randn(50, generator=gen), torch.randn(50, generator=gen) * 1e-2
    v = torch.rand(50, generator=gen) * 1e-4
    lr, wd, b1, b2, eps, step = 0.05, 0.1, 0.9, 0.95, 1e-8, 4
    ranges = ((3, 20), (30, 41))
    got = adamw_update_sq_norm(w, m, v, lr=lr, weight_decay=wd, beta1=b1, beta2=b2, eps=eps, step=step,
                               decay_ranges=ranges)
    u = (m / (1 - b1 ** step)) / (v.sqrt() / math.sqrt(1 - b2 ** step) + eps)
    mask = torch.zeros(50, dtype=torch.bool)
    for s, e in ranges:
        mask[s:e] = True
    w_old = torch.where(mask, (w + lr * u) / (1 - lr * wd), w + lr * u)
    assert got.item() == pytest.approx(((w - w_old).double() ** 2).sum().item(), rel=1e-5)


def test_lora_has_blocks_only():
    config = make_config(model={"lora": {"rank": 2}})
    engine = build_engine(plan_of(config))
    engine.train_step(batches(config, 1), lr=1e-2)
    got = block_metrics(engine, 1e-2)
    assert len(got["block_grad_norm"]) == 3 and "embed_grad_norm" not in got
    assert all(x is not None and x >= 0 for x in got["block_update_norm"])


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_a_step_the_bad_step_gate_skips_has_update_norm_zero(engine_kind):
    config = make_config(training={"engine": engine_kind})
    engine = build_engine(plan_of(config))
    data = batches(config, 2)
    engine.train_step([data[0]], lr=1e-2)
    engine.step_gate = lambda loss, norm: True  # apr/train/badsteps.py's decision: skip this step
    before = _group_weights(engine)
    result = engine.train_step([data[1]], lr=1e-2)
    assert result.flagged and max(_real_norms(before, _group_weights(engine)).values()) == 0.0
    got = block_metrics(engine, 1e-2)
    assert got["block_update_norm"] == [0.0] * 3 and got["max_block_update_norm"] == 0.0
    assert got["max_block_grad_norm"] > 0  # the skipped step's gradient is still reported


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
@pytest.mark.parametrize("optimizer", ["sgd", "swats"])
def test_sgd_and_swats_log_gradient_norms_and_leave_update_norms_unknown(engine_kind, optimizer):
    """AdamW's update formula does not describe SGD's or SWATS's step: their update norms are NaN
    (not logged), never AdamW's figure, and a log step does not fail on either source."""
    config = make_config(training={"engine": engine_kind}, optimizer={"name": optimizer})
    engine = build_engine(plan_of(config))
    engine.train_step(batches(config, 1), lr=1e-2)
    updates = blocknorms.group_update_sq_norms(engine, 1e-2)
    assert set(updates) == set(engine.group_names) and all(math.isnan(v.item()) for v in updates.values())


def test_a_group_autograd_left_without_a_gradient_has_update_norm_zero():
    config = make_config(training={"engine": "standard"})
    engine = build_engine(plan_of(config))
    engine.train_step(batches(config, 1), lr=1e-2)
    engine.gradients.idle_groups = {"block.0"}  # as distillation's phase 1 leaves the blocks it does not train
    updates = blocknorms.group_update_sq_norms(engine, 1e-2)
    assert updates["block.0"].item() == 0.0 and updates["block.1"].item() > 0.0
