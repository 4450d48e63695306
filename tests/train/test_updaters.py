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


@pytest.mark.parametrize("name", ["sgd", "swats", "lion"])
def test_validate_accepts_group_updaters_on_every_source_and_refuses_only_adafactor_on_shards(tmp_path, name):
    from apr.config.loader import load_config
    from apr.plan.orchestratefacts import orchestrator_findings

    def findings(optimizer, training):
        path = tmp_path / "cfg.yaml"
        path.write_text(to_yaml({**make_config().model_dump(mode="json"), "optimizer": {"name": optimizer},
                                 "training": {**make_config().training.model_dump(mode="json"), **training}}))
        return [f for f in orchestrator_findings(load_config(path), 10) if f.path == "optimizer.name"]

    for training in ({"engine": "standard"}, {"engine": "interleaved"},
                     {"sharding": "full", "world_size": 2, "engine": "standard"},
                     {"sharding": "hybrid", "world_size": 2, "nodes": 2, "engine": "interleaved"}):
        assert findings(name, training) == [], training  # update_group on every source (tests/distributed)
    (refusal,) = findings("adafactor", {"sharding": "full", "world_size": 2, "engine": "standard"})
    assert refusal.severity == "error" and "training.sharding: full" in refusal.message


def test_swats_sums_its_switch_test_over_the_groups_pieces_as_over_one_flat_group():
    """The group's dot products over several pieces (a sharded group's local shards) decide the switch
    as the one flat buffer does: the same weights, moments and switch step."""
    from apr.train.updaters import SWATS, Piece

    opt = OptimizerConfig(name="swats", lr=0.1, swats_min_steps=2, swats_tolerance=1e-2, weight_decay=0.0)
    torch.manual_seed(0)
    target = torch.randn(40)
    whole, parts = SWATS(opt, get_backend("torch", "cpu")), SWATS(opt, get_backend("torch", "cpu"))
    p1, m1, v1 = torch.zeros(40), torch.zeros(40), torch.zeros(40)
    p2, m2, v2 = torch.zeros(40), torch.zeros(40), torch.zeros(40)
    decay = DecayRanges.from_segments([(40, False)])
    halves = DecayRanges.from_segments([(20, False)])
    for step in range(1, 40):
        whole.update_flat(p1, p1 - target, m1, v1, lr=opt.lr, step=step, decay=decay, group="g")
        g = p2 - target
        parts.update_group("g", [Piece(p2[:20], g[:20], m2[:20], v2[:20], halves),
                                 Piece(p2[20:], g[20:], m2[20:], v2[20:], halves)], lr=opt.lr, step=step)
    assert whole.switched() and parts.switched() == whole.switched()
    assert torch.allclose(p1, p2, rtol=1e-5, atol=1e-6) and torch.allclose(m1, m2, rtol=1e-5, atol=1e-6)


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


# ------------------------------------------------------------------------------------ Lion, Adafactor

LION = OptimizerConfig(name="lion", lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)


def test_lion_follows_the_papers_rule():
    """Three steps of the flat update against the rule written out: c = b1 m + (1 - b1) g;
    w -= lr (sign(c) + wd w) on the decayed range, lr sign(c) elsewhere; m = b2 m + (1 - b2) g."""
    from apr.train.updaters import Lion

    gen, _, decay = _flat_problem()
    w = torch.randn(40, generator=gen)
    grads = [torch.randn(40, generator=gen) for _ in range(3)]
    decayed = torch.zeros(40, dtype=torch.bool)
    for s, e in decay.ranges:
        decayed[s:e] = True
    up, p, m = Lion(LION, get_backend("torch", "cpu")), w.clone(), torch.zeros(40)
    ref_w, ref_m = w.clone(), torch.zeros(40)
    for step, g in enumerate(grads, start=1):
        up.update_flat(p, g.clone(), m, torch.zeros(40), lr=0.05, step=step, decay=decay)
        c = LION.beta1 * ref_m + (1 - LION.beta1) * g
        ref_w = ref_w - 0.05 * (torch.sign(c) + torch.where(decayed, LION.weight_decay * ref_w, 0.0))
        ref_m = LION.beta2 * ref_m + (1 - LION.beta2) * g
    torch.testing.assert_close(p, ref_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(m, ref_m, rtol=0, atol=1e-7)
    assert not torch.equal(p, w)
    # the squared update norm kept for monitoring.block_norms is the last step's ||w_new - w_old||^2
    before = p.clone()
    up.update_flat(p, grads[0].clone(), m, torch.zeros(40), lr=0.05, step=4, decay=decay, group="g")
    torch.testing.assert_close(up.update_sq["g"], ((p - before) ** 2).sum(), rtol=1e-5, atol=0)


def test_lion_writes_nothing_on_a_flagged_step():
    from apr.train.updaters import Lion

    gen, _, decay = _flat_problem()
    p, m = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    before = p.clone(), m.clone()
    up = Lion(LION, get_backend("torch", "cpu"))
    up.update_flat(p, torch.full((40,), float("nan")), m, torch.zeros(40), lr=0.5, step=3, decay=decay,
                   found_inf=torch.tensor(True))
    assert torch.equal(p, before[0]) and torch.equal(m, before[1])


def test_adafactors_first_step_is_the_factored_rule():
    """One step on a matrix that decays and a vector that does not, against Adafactor written out:
    row and column means of g^2, their product over the rows' mean, the update g / sqrt(that) scaled
    to RMS <= d, a relative step max(eps2, RMS(w)) x min(lr, 1); and a checkpoint's views of the
    statistics give them back exactly."""
    from apr.train.updaters import Adafactor

    opt = OptimizerConfig(name="adafactor", lr=0.05, weight_decay=0.1)
    gen = torch.Generator().manual_seed(4)
    w, b = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    gw, gb = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    named = {"w": torch.nn.Parameter(w.clone()), "b": torch.nn.Parameter(b.clone())}
    up = Adafactor(opt, get_backend("torch", "cpu"))
    up.bind(named, {"w"}, torch.device("cpu"))
    named["w"].grad, named["b"].grad = gw.clone(), gb.clone()
    up.step(opt.lr)
    eps1 = torch.finfo(torch.float32).eps
    row, col = (gw * gw).mean(dim=1, keepdim=True), (gw * gw).mean(dim=0, keepdim=True)
    u = gw / (row @ col / row.mean()).clamp(min=eps1 * eps1).sqrt()
    alpha = max(1e-3, float(w.pow(2).mean().sqrt())) * 0.05
    expect_w = w * (1 - 0.05 * 0.1) - alpha / max(1.0, float(u.pow(2).mean().sqrt())) * u
    ub = gb / (gb * gb).clamp(min=eps1 * eps1).sqrt()
    expect_b = b - max(1e-3, float(b.pow(2).mean().sqrt())) * 0.05 / max(1.0, float(ub.pow(2).mean().sqrt())) * ub
    torch.testing.assert_close(named["w"].detach(), expect_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(named["b"].detach(), expect_b, rtol=1e-5, atol=1e-6)
    m, v = up.moments(named["w"])
    assert m.shape == v.shape == (4, 3)
    torch.testing.assert_close(m[:, :1], row) and torch.testing.assert_close(v[:1, :], col)
    again = Adafactor(opt, get_backend("torch", "cpu"))
    again.bind({"w": named["w"], "b": named["b"]}, {"w"}, torch.device("cpu"))
    for p in named.values():
        again.set_moments(p, *(t.clone() for t in up.moments(p)), step=1)
        assert all(torch.equal(x, y) for x, y in zip(again.moments(p), up.moments(p), strict=True))


def _engine_config(name: str, engine: str):
    return make_config(optimizer={"name": name, "lr": 1e-2}, training={"engine": engine, "grad_clip": None})


@pytest.mark.parametrize(("name", "engine"), [("lion", "interleaved"), ("lion", "standard"),
                                              ("adafactor", "standard")])
def test_lion_and_adafactor_resume_bitwise_from_their_checkpointed_state(name, engine):
    """Six steps straight, or three, the state through checkpoint-shaped tensors and JSON meta into
    a fresh engine, then three more: the same weights and optimizer state, bit for bit."""
    import json

    from apr.train.build import build_engine
    from tests.train.tiny import batches

    config = _engine_config(name, engine)
    data = batches(config, 6, seed=7)
    straight = build_engine(plan_of(config))
    for b in data:
        straight.train_step([b], lr=1e-2)
    first = build_engine(plan_of(config))
    for b in data[:3]:
        first.train_step([b], lr=1e-2)
    saved = {k: v.contiguous().clone() for k, v in first.train_state_tensors().items()}
    meta = json.loads(json.dumps(first.meta_state()))
    resumed = build_engine(plan_of(config), seed=99)
    resumed.load_train_state_tensors(saved)
    resumed.load_meta_state(meta)
    for b in data[3:]:
        resumed.train_step([b], lr=1e-2)
    a, r = straight.train_state_tensors(), resumed.train_state_tensors()
    assert set(a) == set(r)
    assert all(torch.equal(a[k], r[k]) for k in a), [k for k in a if not torch.equal(a[k], r[k])][:3]
    assert any(k.startswith("optimizer.m.") and a[k].abs().sum() > 0 for k in a)  # the state is not empty


def test_lion_on_autograd_trains_as_on_the_walk():
    from apr.train.build import build_engine
    from tests.train.tiny import batches

    data = batches(_engine_config("lion", "standard"), 5, seed=8)
    walk = build_engine(plan_of(_engine_config("lion", "interleaved")))
    auto = build_engine(plan_of(_engine_config("lion", "standard")))
    for b in data:
        walk.train_step([b], lr=1e-2)
        auto.train_step([b], lr=1e-2)
    a, w = auto.train_state_tensors(), walk.train_state_tensors()
    weights = [k for k in w if not k.startswith("optimizer.")]
    # sign(c) flips where c is within rounding of zero: nearly every weight agrees to float32 rounding
    agree = sum(int(torch.isclose(a[k], w[k], rtol=1e-5, atol=1e-6).sum()) for k in weights)
    assert agree >= 0.999 * sum(w[k].numel() for k in weights)


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_the_plans_optimizer_rows_are_what_the_updater_holds(name):
    """Autograd: Lion holds one fp32 moment per weight, Adafactor a row statistic per matrix row and
    a column statistic per column (a vector: its own second moment); the plan's rows say so."""
    from apr.memory.buffers import autograd_buffers
    from apr.train.build import build_engine
    from tests.train.tiny import batches

    config = _engine_config(name, "standard")
    engine = build_engine(plan_of(config))
    engine.train_step([batches(config, 1)[0]], lr=1e-2)
    up = engine.updater
    if name == "lion":  # each group's momentum, flat; the second buffer is one zero per group
        held_m = sum(m.nbytes for *_, m, _v in up._groups)
        held_v = sum(v.nbytes for *_, v in up._groups)
        assert held_v == 4 * len(up._groups)
        held_v = 0
    else:
        states = list(up.optimizer.state.values())
        held_m = sum(s["row_var"].nbytes for s in states if "row_var" in s)
        held_v = sum(s["col_var"].nbytes if "col_var" in s else s["variance"].nbytes for s in states)
    declared: dict[str, int] = {}
    for b in autograd_buffers(config):
        declared[b.component] = declared.get(b.component, 0) + b.nbytes
    assert (held_m, held_v) == (declared["adamw_m"], declared.get("adamw_v", 0))
    weights = sum(b.nbytes for b in autograd_buffers(config) if b.component == "weights")
    assert held_m + held_v <= (weights if name == "lion" else weights / 10)


def test_validate_refuses_adafactor_on_the_walk_and_both_under_sharding(tmp_path):
    from apr.config.loader import load_config
    from apr.plan.orchestratefacts import orchestrator_findings

    def findings(name, training):
        path = tmp_path / "cfg.yaml"
        path.write_text(to_yaml({**make_config().model_dump(mode="json"), "optimizer": {"name": name},
                                 "training": {**make_config().training.model_dump(mode="json"), **training}}))
        return [f for f in orchestrator_findings(load_config(path), 10) if f.path == "optimizer.name"]

    assert findings("adafactor", {"engine": "standard"}) == []
    assert findings("lion", {"engine": "interleaved"}) == []
    (walk,) = findings("adafactor", {"engine": "interleaved"})
    assert walk.severity == "error" and "shapes" in walk.message and walk.expected.startswith("training.engine")
    (sharded,) = findings("adafactor", {"engine": "standard", "sharding": "full", "world_size": 2})
    assert "rows" in sharded.message and "training.sharding: full" in sharded.message
    assert findings("lion", {"sharding": "full", "world_size": 2}) == []  # update_group on shards


@pytest.mark.parametrize(("name", "engine"), [("lion", "interleaved"), ("adafactor", "standard")])
def test_a_run_resumed_from_a_middle_checkpoint_ends_bitwise_equal(name, engine, tmp_path):
    """apr train apply with each optimizer: a run resumed from its step-2 checkpoint (weights and the
    optimizer's state in the safetensors) ends with the same weights and state as the run straight."""
    import shutil

    from run_helpers import make_dataset, write_config
    from safetensors.torch import load_file

    from apr.apply import run_apply

    make_dataset(tmp_path, train_rows=48, val_rows=8)
    sections = {"optimizer": {"name": name, "lr": 1e-2, "beta2": 0.99},
                "training": {"engine": engine, "max_steps": 4, "save_interval": 2, "eval_interval": 0}}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    assert run_apply(write_config(tmp_path, **sections), **quiet).final_step == 4
    other = tmp_path / "other"
    (other / "run").mkdir(parents=True)
    for suffix in ("json", "safetensors"):
        shutil.copy(tmp_path / "run" / f"checkpoint-step-2.{suffix}", other / "run")
    sections["training"]["output_dir"] = str(other / "run")
    resumed = run_apply(write_config(tmp_path, "other.yaml", **sections), resume="latest", **quiet)
    assert resumed.start_step == 2 and resumed.final_step == 4
    final = load_file(str(tmp_path / "run" / "checkpoint-step-4.safetensors"))
    again = load_file(str(other / "run" / "checkpoint-step-4.safetensors"))
    assert set(final) == set(again) and any(k.startswith("optimizer.m.") for k in final)
    assert [k for k in final if not torch.equal(final[k], again[k])] == []


@pytest.mark.parametrize(("name", "engine"), [("lion", "interleaved"), ("lion", "standard"),
                                              ("adafactor", "standard")])
def test_block_norms_record_lions_update_and_leave_adafactors_out(name, engine):
    """monitoring.block_norms: Lion's per-block update norm is ||w_new - w_old|| of the step (it
    cannot be derived from the state after the step as AdamW's is); Adafactor's is not recorded
    (None), its gradient norms are."""
    from apr.train.blocknorms import block_metrics
    from apr.train.build import build_engine
    from tests.train.tiny import batches

    config = _engine_config(name, engine)
    eng = build_engine(plan_of(config))
    data = batches(config, 2, seed=9)
    eng.train_step([data[0]], lr=1e-2)
    before = {k: v.clone() for k, v in eng.train_state_tensors().items()}
    eng.train_step([data[1]], lr=1e-2)
    after = eng.train_state_tensors()
    metrics = block_metrics(eng, 1e-2)
    assert all(g is not None and g > 0 for g in metrics["block_grad_norm"])
    if name == "adafactor":
        assert metrics["block_update_norm"] == [None] * 3
        return
    for i, recorded in enumerate(metrics["block_update_norm"]):
        moved = [k for k in after if k.startswith(f"model.layers.{i}.")]
        expect = sum(float(((after[k] - before[k]) ** 2).sum()) for k in moved) ** 0.5
        assert recorded == pytest.approx(expect, rel=1e-4)


def test_validate_refuses_adafactor_keys_for_another_optimizer(tmp_path):
    from apr.config.loader import load_config
    from apr.plan.orchestratefacts import orchestrator_findings

    path = tmp_path / "cfg.yaml"
    doc = {**make_config().model_dump(mode="json", exclude_unset=True),
           "optimizer": {"name": "lion", "adafactor_eps2": 1e-2}}
    path.write_text(to_yaml(doc))
    (refusal,) = [f for f in orchestrator_findings(load_config(path), 10) if f.path.startswith("optimizer.")]
    assert refusal.severity == "error" and refusal.path == "optimizer.adafactor_eps2" and "lion" in refusal.message
    path.write_text(to_yaml({**doc, "optimizer": {"name": "adafactor", "adafactor_eps2": 1e-2},
                             "training": {**doc["training"], "engine": "standard"}}))
    assert [f for f in orchestrator_findings(load_config(path), 10) if f.path.startswith("optimizer.")] == []


# ------------------------------------------------------------------ bf16 state (training.state_dtype)


def _bf16_state_config(**training):
    return make_config(optimizer={"lr": 1e-2}, training={"mixed_precision": "bf16", "state_dtype": "bf16",
                                                         **training})


def test_bf16_state_holds_6_bytes_a_parameter_and_resumes_bitwise():
    """The walk's weights, moments and gradients are bf16 buffers: 6 bytes a parameter of weights and
    moments, as the plan's buffer list says; the weights move; four steps straight equal two, the
    state through checkpoint-shaped tensors into a fresh engine, then two more, bit for bit."""
    import json

    from apr.memory.buffers import walk_buffers
    from apr.model.spec import param_count
    from apr.train.build import build_engine
    from tests.train.tiny import batches

    config = _bf16_state_config()
    data = batches(config, 4, seed=7)
    straight = build_engine(plan_of(config))
    first = {k: v.clone() for k, v in straight.train_state_tensors().items()}
    losses = [float(straight.train_step([b], lr=1e-2).loss) for b in data]
    tensors = straight.train_state_tensors()
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert all(torch.isfinite(torch.tensor(x)) for x in losses)
    assert not torch.equal(tensors["model.layers.0.mlp.up_proj.weight"], first["model.layers.0.mlp.up_proj.weight"])
    measured = straight.buffer_bytes()
    declared = {b.name: b.nbytes for b in walk_buffers(config)}
    assert {n: measured[n] for n in declared if n in measured} == {n: declared[n] for n in declared if n in measured}
    state = sum(v for n, v in measured.items() if n.endswith((".flat_params", ".adam_m", ".adam_v")))
    assert state == 6 * param_count(config.model.architecture)
    assert not any(n.endswith(".compute") for n in measured)  # the bf16 weights are the compute copy
    half = build_engine(plan_of(config))
    for b in data[:2]:
        half.train_step([b], lr=1e-2)
    saved = {k: v.contiguous().clone() for k, v in half.train_state_tensors().items()}
    meta = json.loads(json.dumps(half.meta_state()))
    resumed = build_engine(plan_of(config), seed=99)
    resumed.load_train_state_tensors(saved)
    resumed.load_meta_state(meta)
    for b in data[2:]:
        resumed.train_step([b], lr=1e-2)
    again = resumed.train_state_tensors()
    assert [k for k in tensors if not torch.equal(tensors[k].view(torch.int16), again[k].view(torch.int16))] == []


def test_bf16_state_trains_as_fp32_state_on_a_tiny_model():
    """Twenty steps of the same batches: the bf16-state loss stays within 2% of the fp32-state one."""
    from apr.train.build import build_engine
    from tests.train.tiny import batches

    data = batches(make_config(), 4, seed=3)
    finals = {}
    for dtype in ("fp32", "bf16"):
        engine = build_engine(plan_of(make_config(optimizer={"lr": 1e-2},
                                                  training={"mixed_precision": "bf16", "state_dtype": dtype})))
        losses = [float(engine.train_step([data[i % 4]], lr=1e-2).loss) for i in range(20)]
        finals[dtype] = sum(losses[-4:]) / 4
        assert losses[-1] < losses[0]
    assert abs(finals["bf16"] - finals["fp32"]) / finals["fp32"] < 0.02, finals


def test_a_bf16_state_run_checkpoints_bf16_and_resumes_bitwise(tmp_path):
    """apr train apply with bf16 state: the checkpoint's tensors are bf16 (weights and moments), and a
    run resumed from its step-2 checkpoint ends bitwise equal to the run straight."""
    import shutil

    from run_helpers import make_dataset, write_config
    from safetensors.torch import load_file

    from apr.apply import run_apply

    make_dataset(tmp_path, train_rows=48, val_rows=8)
    sections = {"optimizer": {"lr": 1e-2}, "training": {"max_steps": 4, "save_interval": 2, "eval_interval": 0,
                                                        "mixed_precision": "bf16", "state_dtype": "bf16"}}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    assert run_apply(write_config(tmp_path, **sections), **quiet).final_step == 4
    other = tmp_path / "other"
    (other / "run").mkdir(parents=True)
    for suffix in ("json", "safetensors"):
        shutil.copy(tmp_path / "run" / f"checkpoint-step-2.{suffix}", other / "run")
    sections["training"]["output_dir"] = str(other / "run")
    resumed = run_apply(write_config(tmp_path, "other.yaml", **sections), resume="latest", **quiet)
    assert resumed.start_step == 2 and resumed.final_step == 4
    final = load_file(str(tmp_path / "run" / "checkpoint-step-4.safetensors"))
    again = load_file(str(other / "run" / "checkpoint-step-4.safetensors"))
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert set(final) == set(again) and any(k.startswith("optimizer.v.") for k in final)
    assert [k for k in final if not torch.equal(final[k].view(torch.int16), again[k].view(torch.int16))] == []


def test_adamw_update_group_on_parameters_is_torch_adamw_bitwise():
    """The autograd sources' AdamW goes through update_group like every source: per optimizer group,
    torch's own multi-tensor rule, ending bitwise where torch.optim.AdamW.step does; a parameter
    without a gradient keeps its moments and step count, a frozen one is not touched."""
    torch.manual_seed(0)
    shapes = {"a.w": (6, 4), "a.norm": (4,), "b.w": (4, 4), "b.bias": (4,), "c.w": (3, 4)}
    init = {n: torch.randn(s) for n, s in shapes.items()}
    decayed = {"a.w", "b.w", "c.w"}
    ours = {n: t.clone().requires_grad_() for n, t in init.items()}
    ref = {n: t.clone().requires_grad_() for n, t in init.items()}
    up = AdamW(OptimizerConfig(lr=1e-2, weight_decay=0.1), get_backend("torch", "cpu"))
    up.bind(ours, decayed, torch.device("cpu"), groups=[("a", [ours["a.w"], ours["a.norm"]]),
                                                        ("b", [ours["b.w"], ours["b.bias"]]), ("c", [ours["c.w"]])])
    torch_opt = torch.optim.AdamW([{"params": [ref[n] for n in shapes if n in decayed], "weight_decay": 0.1},
                                   {"params": [ref[n] for n in shapes if n not in decayed], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(up.beta1, up.beta2), eps=up.eps)
    up.freeze([ours["c.w"]])
    torch_opt.param_groups[0]["params"] = [p for p in torch_opt.param_groups[0]["params"] if p is not ref["c.w"]]
    for step in range(4):
        grads = {n: torch.randn(s) for n, s in shapes.items()}
        for params in (ours, ref):
            for n, p in params.items():
                p.grad = None if (step == 2 and n == "b.bias") else grads[n].clone()
        up.step(1e-2)
        torch_opt.step()
    for n in shapes:
        assert torch.equal(ours[n], ref[n]), n
        if n == "c.w":
            assert torch.equal(ours[n], init[n]) and up.moments(ours[n]) is None  # frozen: untouched
            continue
        m, v = up.moments(ours[n])
        state = torch_opt.state[ref[n]]
        assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])
        assert up.steps_of(ours[n]) == int(torch_opt.state[ref[n]]["step"]) == (3 if n == "b.bias" else 4)
