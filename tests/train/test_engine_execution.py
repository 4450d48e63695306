"""Every execution policy of the interleaved engine trains the same weights as today's lean walk."""

from __future__ import annotations

import pytest
import torch

from apr.model.spec import buffer_plan
from apr.train.engine import build_engine
from tests.train.tiny import batches, make_config

POLICIES = [(a, g) for a in ("keep", "keep_first:1", "keep_first:2", "selective", "recompute")
            for g in ("kept", "workspace")]
LEAN = {"activations": "recompute", "gradients": "workspace"}


def _train(config, steps: int = 3, accum: int = 1, seed: int = 4):
    engine = build_engine(config)
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
        engine = build_engine(config)
        seen = []
        engine.grad_probe = seen.append
        engine.train_step(batches(config, 1), lr=1e-2)
        walks[gradients] = seen.count("head")
    assert walks == {"kept": 1, "workspace": 2}


def test_kept_graphs_mean_no_block_is_recomputed():
    calls = {}
    for activations in ("keep", "keep_first:1", "recompute"):
        config = _config(activations, "kept", "global")
        engine = build_engine(config)
        count = [0]
        for layer in engine.model.model.layers:
            layer.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        engine.train_step(batches(config, 1), lr=1e-2)
        calls[activations] = count[0]
    layers = 3
    assert calls == {"keep": layers, "keep_first:1": 2 * layers - 1, "recompute": 2 * layers}


def test_the_buffer_plan_holds_what_each_gradient_policy_allocates():
    kept = {b.name for b in buffer_plan(_config("keep", "kept", "global")) if b.component == "gradients"}
    lean = {b.name for b in buffer_plan(_config("keep", "workspace", "global")) if b.component == "gradients"}
    assert lean == {"grad_workspace"}
    assert kept == {"embed.grad", "head.grad"} | {f"block.{i}.grad" for i in range(3)}  # no scratch needed
    engine = build_engine(_config("keep", "kept", "global"))
    assert all(g.own_grad is not None for g in engine.groups) and engine.workspace is None
