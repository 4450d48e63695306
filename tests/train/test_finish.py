"""The one step finisher (apr/train/finish.py), on the autograd source: clipping dispatched once by
clip_mode with clip_grad_norm_'s coefficient, a non-finite norm stops before any update, the bad-step
gate skips the update, and the loss part's LR factor scales the step's LR."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from apr.steps.resolved import resolve as plan_of
from apr.train import finish
from apr.train.build import build_engine
from apr.train.finish import clip_
from apr.train.outcome import NonFiniteError
from tests.train.tiny import batches, make_config


def _backward(clip_mode: str, grad_clip: float | None = 0.3):
    engine = build_engine(plan_of(make_config(training={"engine": "standard", "clip_mode": clip_mode,
                                                "grad_clip": grad_clip})))
    finish.begin(engine)
    loss, sq = engine.gradients.accumulate(batches(engine.config, 1))
    return engine, loss, engine.gradients._local, sq


def finish_step(engine, loss, sq, lr):
    """The end of an autograd step as ``Engine.train_step`` runs it."""
    return finish.known(engine, loss, sq, partial(engine.gradients.apply_all, lr=lr, loss=loss), sq_scale=1.0,
                        host=True)


def test_global_clipping_scales_every_gradient_as_clip_grad_norm_does():
    engine, _, local, sq = _backward("global")
    norm = torch.stack(list(sq.values())).sum().sqrt()
    reference = []
    for g in (g for gs in local.values() for g in gs):
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        reference.append(p)
    torch.nn.utils.clip_grad_norm_(reference, 0.3)
    clip_(engine, local, engine._coefs(sq, norm, sq_scale=1.0))
    got = [g for gs in local.values() for g in gs]
    assert norm > 0.3  # the case where clipping acts
    for g, p in zip(got, reference, strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-6, atol=0)
    assert torch.stack([g.pow(2).sum() for g in got]).sum().sqrt() == pytest.approx(0.3, rel=1e-5)


def test_per_block_clipping_bounds_each_group_on_its_own():
    engine, _, local, sq = _backward("per_block", grad_clip=1e-3)
    clip_(engine, local, engine._coefs(sq, torch.stack(list(sq.values())).sum().sqrt(), sq_scale=1.0))
    for gs in local.values():
        assert torch.stack([g.pow(2).sum() for g in gs]).sum().sqrt() == pytest.approx(1e-3, rel=1e-4)


def test_a_non_finite_gradient_stops_before_any_update():
    engine, loss, local, sq = _backward("global")
    before = {k: v.clone() for k, v in engine.train_state_tensors().items()}
    next(iter(local.values()))[0].view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteError) as err:
        finish_step(engine, loss, engine.layout.group_sq(local), 1e-2)
    assert err.value.state_is_last_good and engine.optimizer_steps == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.train_state_tensors().items())


def test_the_gate_skips_the_update_and_the_loss_part_scales_the_lr():
    engine, loss, local, sq = _backward("global", grad_clip=None)  # no clipping
    engine.step_gate = lambda loss, norm: True
    assert finish_step(engine, loss, sq, 1e-2).flagged and engine.optimizer_steps == 0
    engine.step_gate, engine._skip = None, False
    engine.loss.lr_factor = lambda loss: 0.5
    result = finish_step(engine, loss, sq, 1e-2)
    assert not result.flagged and engine.optimizer_steps == 1
    assert all(pg["lr"] == 5e-3 for pg in engine.updater.optimizer.param_groups)
