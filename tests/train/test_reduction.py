"""apr/train/reduction.py: the fixed tree of canonical reduction, and one process with it."""

from __future__ import annotations

import pytest
import torch

from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from apr.train.reduction import tree_sum
from tests.train.tiny import batches, make_config


def test_the_tree_depends_on_the_number_of_leaves_only():
    # float32 addition is not associative: these leaves give another sum in another order
    leaves = [torch.tensor(v, dtype=torch.float32) for v in (5.0, -7.0, 0.5, 5.0, -1e8)]
    a, b, c, d, e = leaves
    assert torch.equal(tree_sum(leaves), ((a + b) + c) + (d + e))
    assert not torch.equal(tree_sum(leaves), (((a + b) + c) + d) + e)  # not the sequential sum
    assert torch.equal(tree_sum([a]), a)
    with pytest.raises(ValueError):
        tree_sum([])


def test_one_process_sums_its_micro_batches_in_the_tree_to_fasts_gradient_within_rounding():
    canonical = make_config(training={"engine": "standard", "reduction": "canonical", "gradient_accumulation": 3,
                                      "grad_clip": None})
    fast = make_config(training={"engine": "standard", "gradient_accumulation": 3, "grad_clip": None})
    data = batches(canonical, 3, seed=3)
    a, b = build_engine(plan_of(canonical)), build_engine(plan_of(fast))
    ra, rb = a.train_step(data, lr=1e-2), b.train_step(data, lr=1e-2)
    assert ra.loss.item() == pytest.approx(rb.loss.item(), rel=1e-6)
    assert ra.grad_norm.item() == pytest.approx(rb.grad_norm.item(), rel=1e-6)
    named_a, named_b = a.gradients.named, b.gradients.named
    for name, p in named_b.items():  # the step's mean gradient, left in .grad by both
        rel = ((named_a[name].grad - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
        assert rel <= 1e-5, name
