"""Every execution policy of the interleaved engine trains the same weights as today's lean walk."""

from __future__ import annotations

import pytest
import torch

from apr.memory.buffers import buffer_plan
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from tests.train.tiny import batches, make_config

POLICIES = [(a, g) for a in ("keep", "keep_first:1", "keep_first:2", "selective", "recompute")
            for g in ("kept", "workspace")]
LEAN = {"activations": "recompute", "gradients": "workspace"}


def _train(config, steps: int = 3, accum: int = 1, seed: int = 4):
    engine = build_engine(plan_of(config))
    data = batches(config, steps * accum, seed=seed)
    norms = [engine.train_step(data[k * accum:(k + 1) * accum], lr=1e-2).grad_norm.item() for k in range(steps)]
    return engine.train_state_tensors(), norms


def _config(activations: str, gradients: str, clip: str | None, accum: int = 1, tied: bool = False):
    return make_config(model={"architecture": {"tie_word_embeddings": tied}},
                       training={"execution": {"activations": activations, "gradients": gradients},
                                 "clip_mode": clip or "global", "grad_clip": 0.3 if clip else None,
                                 "gradient_accumulation": accum})


@pytest.mark.parametrize("activations,gradients", POLICIES)
@pytest.mark.parametrize("clip", ["global", "per_block", None])
def test_every_policy_gives_the_lean_walks_weights_bitwise(activations, gradients, clip):
    # The same float operations in the same order, whether a block's graph is kept, partly kept or
    # recomputed, and whether its gradient lands in its own buffer or the shared workspace.
    got, norms = _train(_config(activations, gradients, clip))
    want, want_norms = _train(_config(LEAN["activations"], LEAN["gradients"], clip))
    assert norms == want_norms
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("activations", ["keep", "selective", "keep_first:2"])
@pytest.mark.parametrize("tied", [False, True])
def test_policies_agree_under_accumulation_and_tied_embeddings(activations, tied):
    got, _ = _train(_config(activations, "kept", "global", accum=2, tied=tied), accum=2)
    want, _ = _train(_config("recompute", "kept", "global", accum=2, tied=tied), accum=2)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_tied_kept_gradients_without_accumulation_match_the_workspace():
    got, _ = _train(_config("keep", "kept", "global", tied=True))
    want, _ = _train(_config("recompute", "workspace", "global", tied=True))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_kept_gradients_take_one_walk_and_the_workspace_two_under_global_clipping():
    walks = {}
    for gradients in ("kept", "workspace"):
        config = _config("keep", gradients, "global")
        engine = build_engine(plan_of(config))
        seen = []
        engine.grad_probe = seen.append
        engine.train_step(batches(config, 1), lr=1e-2)
        walks[gradients] = seen.count("head")
    assert walks == {"kept": 1, "workspace": 2}


def _block_forwards(config) -> int:
    """Block forwards of one step (a pre-hook: torch.utils.checkpoint's recompute stops once it has
    what the backward needs, before a forward hook would run)."""
    engine = build_engine(plan_of(config))
    count = [0]
    for layer in engine.model.model.layers:
        layer.register_forward_pre_hook(lambda *a, count=count: count.__setitem__(0, count[0] + 1))
    engine.train_step(batches(config, 1), lr=1e-2)
    return count[0]


def test_kept_graphs_mean_no_block_is_recomputed():
    calls = {a: _block_forwards(_config(a, "kept", "global")) for a in ("keep", "keep_first:1", "recompute")}
    layers = 3
    assert calls == {"keep": layers, "keep_first:1": 2 * layers - 1, "recompute": 2 * layers}


def test_the_buffer_plan_holds_what_each_gradient_policy_allocates():
    kept = {b.name for b in buffer_plan(_config("keep", "kept", "global")) if b.component == "gradients"}
    lean = {b.name for b in buffer_plan(_config("keep", "workspace", "global")) if b.component == "gradients"}
    assert lean == {"grad_workspace"}
    assert kept == {"embed.grad", "head.grad"} | {f"block.{i}.grad" for i in range(3)}  # no scratch needed
    engine = build_engine(plan_of(_config("keep", "kept", "global")))
    assert all(g.own_grad is not None for g in engine.gradients.groups) and engine.gradients.workspace is None


# ------------------------------------------------------------------------------------ AdaGC


def _adagc(engine_kind: str, **execution):
    return make_config(training={"engine": engine_kind, "clip_mode": "adagc", "grad_clip": 0.3,
                                 "adagc": {"warmup_steps": 2, "threshold": 0.9, "beta": 0.9},
                                 **({"execution": execution} if execution else {})})


def test_adagc_clips_each_tensor_and_the_interleaved_engine_matches_the_standard_one():
    got, norms = _train(_adagc("interleaved", activations="recompute", gradients="workspace"), steps=8)
    want, _ = _train(_adagc("standard"), steps=8)
    assert got.keys() == want.keys()
    rel = max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)).item() for k in want)
    assert rel <= 1e-6
    off, _ = _train(make_config(training={"grad_clip": None}), steps=8)
    assert not all(torch.equal(off[k], got[k]) for k in off)  # the clipping changed the training


@pytest.mark.parametrize("activations,gradients", [("keep", "kept"), ("selective", "workspace")])
def test_adagc_is_the_same_under_every_policy(activations, gradients):
    got, _ = _train(_adagc("interleaved", activations=activations, gradients=gradients), steps=5)
    want, _ = _train(_adagc("interleaved", activations="recompute", gradients="workspace"), steps=5)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_adagc_warmup_clips_each_tensor_to_grad_clip():
    config = _adagc("interleaved")
    engine = build_engine(plan_of(config))
    engine.train_step(batches(config, 1), lr=1e-2)
    ema = torch.cat(list(engine.adagc_ema.values()))
    assert bool((ema <= 0.3 + 1e-6).all()) and bool((ema > 0).all())  # first step: the clipped norms


def test_adagc_state_resumes_bitwise():
    config = _adagc("interleaved", activations="recompute", gradients="workspace")
    data = batches(config, 6, seed=2)
    straight = build_engine(plan_of(config))
    for b in data:
        straight.train_step([b], lr=1e-2)
    first = build_engine(plan_of(config))
    for b in data[:3]:
        first.train_step([b], lr=1e-2)
    saved = {k: v.clone() for k, v in first.train_state_tensors().items()}
    resumed = build_engine(plan_of(config), seed=99)
    resumed.load_train_state_tensors(saved)
    resumed.load_meta_state(first.meta_state())
    for b in data[3:]:
        resumed.train_step([b], lr=1e-2)
    a, b = straight.train_state_tensors(), resumed.train_state_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.meta_state()["adagc_ema"] == resumed.meta_state()["adagc_ema"]
    assert len(straight.meta_state()["adagc_ema"]["block.0"]) == 9  # one EMA per tensor of the block


# ------------------------------------------------------------------ autograd (engine: standard)


def _standard(activations: str):
    return make_config(training={"engine": "standard", "execution": {"activations": activations},
                                 "clip_mode": "global", "grad_clip": 0.3})


@pytest.mark.parametrize("activations", ["selective", "recompute", "keep_first:1"])
def test_autograd_honours_the_activation_policy_with_the_same_weights(activations):
    """training.execution.activations on the autograd source: recomputed blocks run their forward
    again in the backward (they were silently kept before), and train the same weights bitwise."""
    got, norms = _train(_standard(activations))
    want, want_norms = _train(_standard("keep"))
    assert norms == want_norms
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    calls = {policy: _block_forwards(_standard(policy)) for policy in ("keep", activations)}
    layers, recomputed = 3, plan_of(_standard(activations)).execution.recomputed_blocks
    assert recomputed > 0 and calls == {"keep": layers, activations: layers + recomputed}
