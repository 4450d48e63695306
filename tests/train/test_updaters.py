"""apr/train/updaters.py: the updater part of the composed engine. Its two ways of updating (the
kernel backend's fused AdamW on flat tensors; torch's AdamW over named parameters) are the same
AdamW, a frozen parameter is left alone, and adopted moments continue the bias correction."""

from __future__ import annotations

import pytest
import torch

from apr.config.schema import OptimizerConfig
from apr.kernels import get_backend
from apr.kernels.interface import DecayRanges
from apr.plan.examples import to_yaml
from apr.steps.resolved import resolve as plan_of
from apr.train.updaters import AdamW
from tests.train.tiny import make_config

OPT = OptimizerConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _grads(steps: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)) for _ in range(steps)]


def test_the_flat_update_and_torch_adamw_agree():
    """A matrix that decays and a vector that does not, 3 steps: the fused flat update of their
    concatenation equals torch's AdamW over the two tensors."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    grads = _grads(3, gen)
    named = {"w": torch.nn.Parameter(w.clone()), "b": torch.nn.Parameter(b.clone())}
    torch_up = AdamW(OPT, get_backend("torch", "cpu"))
    torch_up.bind(named, {"w"}, torch.device("cpu"))
    flat_up = AdamW(OPT, get_backend("torch", "cpu"))
    flat = torch.cat([w.reshape(-1), b])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    decay = DecayRanges.from_segments([(w.numel(), True), (b.numel(), False)])
    for step, (gw, gb) in enumerate(grads, start=1):
        named["w"].grad, named["b"].grad = gw.clone(), gb.clone()
        torch_up.step(OPT.lr)
        flat_up.update_flat(flat, torch.cat([gw.reshape(-1), gb]), m, v, lr=OPT.lr, step=step, decay=decay)
    torch.testing.assert_close(flat, torch.cat([named["w"].detach().reshape(-1), named["b"].detach()]),
                               rtol=1e-6, atol=1e-7)
    tm, tv = torch_up.moments(named["w"])
    torch.testing.assert_close(m[: w.numel()], tm.reshape(-1), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v[: w.numel()], tv.reshape(-1), rtol=1e-6, atol=1e-10)


def test_a_frozen_parameter_keeps_its_weights_and_moments():
    gen = torch.Generator().manual_seed(1)
    named = {name: torch.nn.Parameter(torch.randn(3, generator=gen)) for name in ("a", "b")}
    up = AdamW(OPT, get_backend("torch", "cpu"))
    up.bind(named, {"a", "b"}, torch.device("cpu"))
    for p in named.values():
        p.grad = torch.randn(3, generator=gen)
    up.step(OPT.lr)
    frozen = named["a"].detach().clone(), *(t.clone() for t in up.moments(named["a"]))
    up.freeze([named["a"]])
    for p in named.values():
        p.grad = torch.randn(3, generator=gen)
    before_b = named["b"].detach().clone()
    up.step(OPT.lr)
    assert torch.equal(named["a"].detach(), frozen[0])
    assert all(torch.equal(x, y) for x, y in zip(up.moments(named["a"]), frozen[1:], strict=True))
    assert not torch.equal(named["b"].detach(), before_b)


def test_adopted_moments_continue_as_the_uninterrupted_update():
    """Resume: moments and the step count set on a fresh updater make its next step the one the
    uninterrupted updater takes (the bias correction continues from the adopted step)."""
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(3)]
    p = torch.nn.Parameter(start.clone())
    up = AdamW(OPT, get_backend("torch", "cpu"))
    up.bind({"p": p}, {"p"}, torch.device("cpu"))
    for g in grads[:2]:
        p.grad = g.clone()
        up.step(OPT.lr)
    saved = p.detach().clone(), *(t.clone() for t in up.moments(p))
    assert up.steps_of(p) == 2
    p.grad = grads[2].clone()
    up.step(OPT.lr)

    q = torch.nn.Parameter(saved[0].clone())
    resumed = AdamW(OPT, get_backend("torch", "cpu"))
    resumed.bind({"q": q}, {"q"}, torch.device("cpu"))
    resumed.set_moments(q, saved[1].clone(), saved[2].clone(), 2)
    q.grad = grads[2].clone()
    resumed.step(OPT.lr)
    assert torch.equal(q.detach(), p.detach())


def _flat_problem(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(40, generator=gen)
    return gen, target, DecayRanges.from_segments([(30, True), (10, False)])


def test_sgd_momentum_is_adamws_first_moment_so_a_switch_starts_warm():
    """SGD keeps its momentum as AdamW's first moment (an EMA of the gradient): the buffer AdamW
    left behind is the one SGD continues, and its step is lr x that moment plus decoupled decay."""
    from apr.train.updaters import SGD

    gen, _, decay = _flat_problem()
    p, g = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    m, v = torch.randn(40, generator=gen), torch.rand(40, generator=gen)
    expect_m = OPT.beta1 * m + (1 - OPT.beta1) * g
    expect_p = p.clone()
    expect_p[:30] *= 1 - 0.5 * OPT.weight_decay
    expect_p -= 0.5 * expect_m
    v_before = v.clone()
    SGD(OPT, get_backend("torch", "cpu")).update_flat(p, g.clone(), m, v, lr=0.5, step=7, decay=decay)
    torch.testing.assert_close(m, expect_m)
    torch.testing.assert_close(p, expect_p)
    assert torch.equal(v, v_before)  # SGD leaves AdamW's second moment as it was


def test_swats_switches_to_sgd_with_the_estimated_rate_once_the_estimate_settles():
    """On a quadratic, the AdamW phase's projected learning rate settles; after swats_min_steps the
    group switches (recorded with its step and rate) and from then on steps as SGD with momentum."""
    from apr.train.updaters import SWATS

    opt = OptimizerConfig(lr=1e-2, weight_decay=0.0, swats_min_steps=5, swats_tolerance=1e-2)
    _, target, decay = _flat_problem()
    up = SWATS(opt, get_backend("torch", "cpu"))
    p, m, v = torch.zeros(40), torch.zeros(40), torch.zeros(40)
    for step in range(1, 200):
        up.update_flat(p, p - target, m, v, lr=opt.lr, step=step, decay=decay, group="block.0")
        if up.switched():
            break
    switched_at = up.switched()["block.0"]
    assert switched_at > opt.swats_min_steps and up.groups["block.0"]["sgd_lr"] > 0
    assert torch.count_nonzero(m) == 0  # SGD's momentum starts from zero
    rate = up.groups["block.0"]["sgd_lr"]
    before, g = p.clone(), p - target
    up.update_flat(p, g.clone(), m, v, lr=opt.lr / 2, step=switched_at + 1, decay=decay, group="block.0")
    torch.testing.assert_close(p, before - (1 - opt.beta1) * (rate / 2) * g)  # the schedule halved it


def test_swats_resumes_exactly_across_its_switch():
    """Engine steps 1-3 with AdamW, a checkpoint (tensors + JSON meta), then steps 4-8 across the
    switch: the resumed engine ends bitwise where the uninterrupted one does, on SGD in every group."""
    import json

    from apr.train.build import build_engine
    from tests.train.tiny import batches, make_config

    config = make_config(optimizer={"name": "swats", "swats_min_steps": 4, "swats_tolerance": 1e6},
                         training={"grad_clip": None})
    data = batches(config, 8, seed=5)
    straight = build_engine(plan_of(config))
    for b in data:
        straight.train_step([b], lr=1e-2)
    assert set(straight.updater.switched().values()) == {5}  # the first step past min_steps
    first = build_engine(plan_of(config))
    for b in data[:3]:
        first.train_step([b], lr=1e-2)
    saved = {k: v.clone() for k, v in first.train_state_tensors().items()}
    meta = json.loads(json.dumps(first.meta_state()))
    resumed = build_engine(plan_of(config), seed=99)
    resumed.load_train_state_tensors(saved)
    resumed.load_meta_state(meta)
    for b in data[3:]:
        resumed.train_step([b], lr=1e-2)
    a, b = straight.train_state_tensors(), resumed.train_state_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.meta_state()["swats"] == straight.meta_state()["swats"]


@pytest.mark.parametrize("name", ["sgd", "swats"])
def test_sgd_and_swats_on_autograd_train_as_on_the_walk_and_resume(name):
    """One updater interface: on autograd (engine: standard) SGD and SWATS gather each optimizer
    group and run the walk's own update, so both sources end at the same weights and moments, and
    SWATS switches at the same step; a checkpoint taken mid-way resumes bitwise."""
    import json

    from apr.train.build import build_engine
    from tests.train.tiny import batches, make_config

    def config(engine):
        return make_config(optimizer={"name": name, "swats_min_steps": 4, "swats_tolerance": 1e6},
                           training={"engine": engine, "grad_clip": None})

    data = batches(config("standard"), 8, seed=5)
    walk, auto = build_engine(plan_of(config("interleaved"))), build_engine(plan_of(config("standard")))
    for b in data:
        walk.train_step([b], lr=1e-2)
        auto.train_step([b], lr=1e-2)
    a, w = auto.train_state_tensors(), walk.train_state_tensors()
    assert set(a) == set(w)
    worst = max(((a[k] - w[k]).abs().max() / w[k].abs().max().clamp_min(1e-30)).item() for k in w)
    assert worst <= 1e-5, worst  # the same update; the gradients differ in summation order only
    if name == "swats":
        assert set(auto.updater.switched().values()) == set(walk.updater.switched().values()) == {5}
    first = build_engine(plan_of(config("standard")))
    for b in data[:3]:
        first.train_step([b], lr=1e-2)
    saved = {k: v.clone() for k, v in first.train_state_tensors().items()}
    meta = json.loads(json.dumps(first.meta_state()))
    resumed = build_engine(plan_of(config("standard")), seed=99)
    resumed.load_train_state_tensors(saved)
    resumed.load_meta_state(meta)
    for b in data[3:]:
        resumed.train_step([b], lr=1e-2)
    r = resumed.train_state_tensors()
    assert all(torch.equal(r[k], a[k]) for k in a)


def test_validate_refuses_sgd_only_on_sharded_state(tmp_path):
    from apr.config.loader import load_config
    from apr.plan.orchestratefacts import orchestrator_findings

    def findings(training):
        path = tmp_path / "cfg.yaml"
        path.write_text(to_yaml({**make_config().model_dump(mode="json"), "optimizer": {"name": "sgd"},
                                 "training": {**make_config().training.model_dump(mode="json"), **training}}))
        return [f for f in orchestrator_findings(load_config(path), 10) if f.path == "optimizer.name"]

    assert findings({"engine": "standard"}) == []  # autograd runs it (GroupedUpdates)
    (refusal,) = findings({"sharding": "full", "world_size": 2})
    assert refusal.severity == "error" and "training.sharding: full" in refusal.message


def test_sgd_writes_nothing_on_a_flagged_step_without_reading_the_flag_on_the_host():
    from apr.train.updaters import SGD

    gen, _, decay = _flat_problem()
    p, m, g = torch.randn(40, generator=gen), torch.randn(40, generator=gen), torch.full((40,), float("nan"))
    before = p.clone(), m.clone()
    up = SGD(OPT, get_backend("torch", "cpu"))
    up.update_flat(p, g, m, torch.zeros(40), lr=0.5, step=3, decay=decay, found_inf=torch.tensor(True))
    assert torch.equal(p, before[0]) and torch.equal(m, before[1])
    g = torch.randn(40, generator=gen)
    expect_m = before[1].lerp(g, 1 - OPT.beta1)
    up.update_flat(p, g.clone(), m, torch.zeros(40), lr=0.5, step=3, decay=decay, found_inf=torch.tensor(False))
    torch.testing.assert_close(m, expect_m)
