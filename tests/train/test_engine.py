"""The interleaved engine against the standard one, its gradient memory, precision and state."""

from __future__ import annotations

import pytest
import torch

from apr.memory.buffers import buffer_plan
from apr.steps.resolved import resolve as plan_of
from apr.train.autograd import Autograd
from apr.train.build import build_engine
from apr.train.engine import NonFiniteError
from apr.train.walk import Walk
from tests.train.tiny import batches, make_config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(config, steps: int, lr: float = 1e-2, seed: int = 0):
    engine = build_engine(plan_of(config))
    accum = config.training.gradient_accumulation
    data = batches(config, steps * accum, seed=seed)
    norms = []
    for k in range(steps):
        result = engine.train_step(data[k * accum:(k + 1) * accum], lr=lr)
        norms.append(result.grad_norm.item())
    return engine, norms


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.train_state_tensors().items() if not k.startswith("optimizer.")}


@pytest.mark.parametrize(
    "accum,clip_mode,tied",
    [(1, "global", False), (1, "global", True), (3, "global", False), (1, "per_block", True), (1, None, False)],
)
def test_interleaved_equals_standard_over_20_steps(accum, clip_mode, tied):
    sections = dict(model={"architecture": {"tie_word_embeddings": tied}},
                    training={"gradient_accumulation": accum, "clip_mode": clip_mode or "global",
                              "grad_clip": 0.3 if clip_mode else None})
    inter, norms_i = _run(make_config(**_with(sections, engine="interleaved")), 20)
    std, norms_s = _run(make_config(**_with(sections, engine="standard")), 20)
    assert isinstance(inter.gradients, Walk) and isinstance(std.gradients, Autograd)
    if clip_mode == "global":
        assert max(norms_s) > 0.3  # clipping is active
    assert norms_i == pytest.approx(norms_s, rel=1e-6)
    a, b = _weights(inter), _weights(std)
    assert a.keys() == b.keys()
    worst = max(_rel(a[k], b[k]) for k in b)
    assert worst <= 1e-6
    moved = max(_rel(a[k], _weights(build_engine(plan_of(make_config(**_with(sections,
                                                                             engine="standard")))))[k]) for k in a)
    assert moved > 1e-2  # the 20 steps did change the weights


def _with(sections: dict, **training) -> dict:
    out = {k: dict(v) for k, v in sections.items()}
    out["training"] = {**out["training"], **training}
    return out


def test_tied_accumulation_matches_standard_up_to_summation_order():
    # The tied embedding sums head and lookup gradients in a different order than autograd: equal
    # to rounding after one step (Adam then amplifies the rounding over many steps).
    sections = dict(model={"architecture": {"tie_word_embeddings": True}}, training={"gradient_accumulation": 2})
    a, _ = _run(make_config(**_with(sections, engine="interleaved")), 1)
    b, _ = _run(make_config(**_with(sections, engine="standard")), 1)
    wa, wb = _weights(a), _weights(b)
    assert max(_rel(wa[k], wb[k]) for k in wb) <= 1e-6


def test_accumulation_equals_one_large_batch():
    # Compared on the gradients: Adam's first update is sign-like, so rounding-level differences
    # in near-zero gradient entries would show up in the weights.
    small = make_config(training={"gradient_accumulation": 2, "grad_clip": None})
    large = make_config(data={"batch_size": 4}, training={"engine": "standard", "grad_clip": None})
    data = batches(small, 2, seed=5)
    e_small, e_large = build_engine(plan_of(small)), build_engine(plan_of(large))
    r1 = e_small.train_step(data, lr=1e-3)
    r2 = e_large.train_step([torch.cat(data)], lr=1e-3)
    assert r1.loss.item() == pytest.approx(r2.loss.item(), rel=1e-6)
    assert r1.grad_norm.item() == pytest.approx(r2.grad_norm.item(), rel=1e-6)
    for g, (name, params) in zip(e_small.gradients.groups, e_large.gradients.groups, strict=True):
        assert g.name == name
        assert _rel(g.own_grad, torch.cat([p.grad.reshape(-1) for p in params])) <= 1e-6, name


def _live_grad_bytes(engine) -> int:
    storages = {}
    for p in engine.model.parameters():
        if p.grad is not None:
            st = p.grad.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("clip_mode", ["global", "per_block"])
def test_peak_live_gradient_bytes_are_one_blocks(clip_mode):
    # A wide block and a small vocabulary: a block is the largest group.
    arch = {"hidden_size": 48, "intermediate_size": 192, "vocab_size": 40, "num_hidden_layers": 4}
    lean = {"activations": "recompute", "gradients": "workspace"}
    config = make_config(model={"architecture": arch}, training={"clip_mode": clip_mode, "execution": lean})
    engine = build_engine(plan_of(config))
    block_bytes = engine.gradients.block_groups[0].numel * 4
    assert block_bytes > max(engine.gradients.embed.numel, engine.gradients.head.numel) * 4
    seen = []
    engine.grad_probe = lambda name: seen.append((name, _live_grad_bytes(engine)))
    engine.train_step(batches(config, 1), lr=1e-3)
    assert {n for n, _ in seen} == {g.name for g in engine.gradients.groups}
    assert max(b for _, b in seen) == block_bytes
    plan_grad_bytes = sum(b.nbytes for b in buffer_plan(config) if b.component == "gradients")
    assert plan_grad_bytes == block_bytes  # the plan's gradient row is what the engine holds

    std_config = make_config(model={"architecture": arch}, training={"engine": "standard"})
    std = build_engine(plan_of(std_config))
    std_seen = []
    std.grad_probe = lambda name: std_seen.append(_live_grad_bytes(std))
    std.train_step(batches(std_config, 1), lr=1e-3)
    total = sum(p.numel() for p in std.model.parameters()) * 4
    assert max(std_seen) == total and total > 4 * block_bytes


def test_parameters_are_views_of_the_flat_buffers():
    engine = build_engine(plan_of(make_config()))
    for g in engine.gradients.groups:
        base = g.flat_params.untyped_storage().data_ptr()
        for p in g.params:
            assert p.untyped_storage().data_ptr() == base
        assert g.flat_params.dtype == g.exp_avg.dtype == g.exp_avg_sq.dtype == torch.float32
    before = engine.model.model.layers[1].mlp.up_proj.weight.detach().clone()
    engine.train_step(batches(make_config(), 1), lr=1e-2)
    after = engine.model.model.layers[1].mlp.up_proj.weight
    assert not torch.equal(before, after)
    assert engine.gradients.block_groups[1].exp_avg.abs().sum() > 0


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_weight_decay_spares_norms_and_embeddings_unless_asked(decay_embeddings):
    config = make_config(optimizer={"weight_decay": 0.5, "decay_embeddings": decay_embeddings},
                         training={"grad_clip": None})
    engine = build_engine(plan_of(config))
    for g in engine.gradients.groups:  # zero gradients: only the decay moves anything
        g.release_grads()
    before = _weights(engine)
    engine.gradients._lr = 0.1
    for g in engine.gradients.groups:
        engine.gradients._apply(g, torch.zeros(g.numel), 1.0)
    after = _weights(engine)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        expect = "norm" not in name and ("embed" not in name or decay_embeddings)
        assert changed == expect, name
        if expect:
            assert torch.allclose(after[name], before[name] * (1 - 0.1 * 0.5))


def test_non_finite_loss_stops_before_any_update():
    config = make_config()
    engine = build_engine(plan_of(config))
    with torch.no_grad():
        engine.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    before = _weights(engine)
    engine.train_step(batches(config, 1), lr=1e-2)  # flagged on the device, read by the check
    with pytest.raises(NonFiniteError) as err:
        engine.check_finite()
    assert err.value.what == "loss" and err.value.state_is_last_good
    after = _weights(engine)
    for k in before:
        assert torch.equal(before[k].nan_to_num(), after[k].nan_to_num()), k
    assert engine.optimizer_steps == 0


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_fp16_overflow_skips_the_step_and_backs_off_the_scale(engine_kind):
    config = make_config(training={"mixed_precision": "fp16", "engine": engine_kind})
    engine = build_engine(plan_of(config))
    engine.scaler.scale = 2.0**127  # gradients overflow float32
    before = _weights(engine)
    result = engine.train_step(batches(config, 1), lr=1e-2)
    assert result.skipped and engine.optimizer_steps == 0
    assert engine.scaler.scale == 2.0**126
    assert all(torch.equal(before[k], v) for k, v in _weights(engine).items())
    result = engine.train_step(batches(config, 1), lr=1e-2)
    assert not result.skipped or engine.scaler.scale < 2.0**126


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_float32_master_state(precision):
    config = make_config(training={"mixed_precision": precision})
    engine = build_engine(plan_of(config))
    data = batches(config, 1, seed=3) * 12
    losses = [engine.train_step([b], lr=1e-2).loss.item() for b in data]
    assert losses[-1] < losses[0] - 0.5
    assert all(t.dtype == torch.float32 for t in engine.train_state_tensors().values())
    ref = build_engine(plan_of(make_config()))
    fp32_loss = ref.train_step(data[:1], lr=1e-2).loss.item()
    assert losses[0] == pytest.approx(fp32_loss, rel=2e-2)


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_train_state_round_trip_resumes_bitwise(engine_kind):
    config = make_config(training={"engine": engine_kind})
    data = batches(config, 6, seed=9)
    straight = build_engine(plan_of(config))
    for b in data:
        straight.train_step([b], lr=1e-2)
    first = build_engine(plan_of(config))
    for b in data[:3]:
        first.train_step([b], lr=1e-2)
    saved = {k: v.clone() for k, v in first.train_state_tensors().items()}
    meta = first.meta_state()
    resumed = build_engine(plan_of(config), seed=1234)  # different init: everything must come from the state
    resumed.load_train_state_tensors(saved)
    resumed.load_meta_state(meta)
    for b in data[3:]:
        resumed.train_step([b], lr=1e-2)
    a, b = straight.train_state_tensors(), resumed.train_state_tensors()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_state_names_follow_hf_and_optimizer_prefixes():
    config = make_config(model={"architecture": {"tie_word_embeddings": True}})
    names = set(build_engine(plan_of(config)).train_state_tensors())
    assert "model.layers.2.mlp.down_proj.weight" in names
    assert "optimizer.m.model.embed_tokens.weight" in names and "optimizer.v.model.norm.weight" in names
    assert "lm_head.weight" not in names  # tied
    from apr.errors import AprError

    with pytest.raises(AprError):
        build_engine(plan_of(config)).load_train_state_tensors({"model.norm.weight": torch.ones(32)})


def test_eval_loss_sum_matches_the_training_loss():
    config = make_config()
    engine = build_engine(plan_of(config))
    batch = batches(config, 1)[0]
    loss_sum, count = engine.eval_loss_sum(batch)
    step = engine.train_step([batch], lr=1e-2)
    assert count == batch.shape[0] * (batch.shape[1] - 1)
    assert (loss_sum / count).item() == pytest.approx(step.loss.item(), rel=1e-6)
