"""The causal-LM loss part goes through the model's one loss entry point: the same number as
``model(ids, targets)``, and evaluation's summed form is the mean times the tokens."""

from __future__ import annotations

import torch

from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from apr.train.losses import CausalLM
from tests.train.tiny import batches, make_config


def test_the_loss_part_the_models_forward_and_evaluation_agree():
    engine = build_engine(plan_of(make_config(training={"engine": "standard"})))
    (batch,) = batches(engine.config, 1)
    ids, targets = engine.split(batch)
    part = CausalLM()(engine, engine.model, ids, targets)
    forward = engine.model(ids, targets, loss_chunk_size=engine.chunk_size)
    assert torch.allclose(part, forward, rtol=1e-6, atol=0)
    total, count = engine.eval_loss_sum(batch)
    assert count == targets.numel() and torch.allclose(total / count, part.detach(), rtol=1e-6, atol=0)
    part.backward()  # differentiable: every weight gets a gradient
    assert all(p.grad is not None for p in engine.gradients.named.values())
