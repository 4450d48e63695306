"""apr/train/reduction.py: the fixed tree of canonical reduction, and one process with it."""

from __future__ import annotations

import pytest
import torch

from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from apr.train.reduction import agreed, tree_sum
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


class ThreeRanks:
    """A data-parallel group of 3 whose every rank holds the same value: the all-reduce adds them in order."""

    world_size = 3

    def __init__(self):
        self.calls = 0

    def average_(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        t.copy_((t + t) + t)
        return t.div_(self.world_size)


def test_a_canonical_step_loss_is_taken_as_it_is_and_a_fast_one_is_averaged_over_the_ranks():
    """The orchestrator's and distillation's decisions read ``agreed``: canonical's loss is already the
    global batch's on every rank, and averaging equal values over 3 ranks does not give them back."""
    loss = torch.tensor([5.55, 2.0], dtype=torch.float32)
    dp = ThreeRanks()
    kept = agreed(dp, loss, canonical=True)
    assert torch.equal(kept, loss) and kept is not loss and dp.calls == 0
    averaged = agreed(dp, loss, canonical=False)
    assert dp.calls == 1 and torch.equal(loss, torch.tensor([5.55, 2.0]))  # the figure handed in is not changed
    assert not torch.equal(averaged, loss)  # (x + x) + x rounds: 5.55 comes back 1 ulp off
    assert torch.equal(agreed(None, loss, canonical=False), loss)


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


@pytest.mark.parametrize(("clip", "model"), [
    (None, {}), (0.5, {}), (0.5, {"lora": {"rank": 4}}), (0.5, {"architecture": {"tie_word_embeddings": True}})],
    ids=["unclipped", "clipped", "lora", "tied"])
def test_the_walk_under_canonical_gives_autograds_canonical_weights_bitwise(clip, model):
    """The flat-buffer walk keeps each micro-batch's whole gradient (its kept buffers, copied into a leaf)
    and sums the leaves in the same tree: its steps are autograd's canonical steps to the bit (float32),
    so whatever holds for autograd's across world sizes holds for the walk's."""
    configs = [make_config(training={"engine": engine, "reduction": "canonical", "gradient_accumulation": 3,
                                     "grad_clip": clip}, model=model) for engine in ("standard", "interleaved")]
    data = batches(configs[0], 3, seed=3)
    standard, walk = (build_engine(plan_of(c)) for c in configs)
    assert walk.gradients.name == "interleaved" and walk.strategy.keeps_all_grads
    for _ in range(3):
        a, b = standard.train_step(data, lr=1e-2), walk.train_step(data, lr=1e-2)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm)
    sa, sb = standard.train_state_tensors(), walk.train_state_tensors()
    assert set(sa) == set(sb)
    assert all(torch.equal(sa[n], sb[n]) for n in sa)  # weights and both moments


def test_the_in_place_tree_gives_the_trees_bits_and_holds_no_temporaries():
    """``tree_sum_`` (canonical's gradient leaves: the mean is the first leaf, no temporaries) adds in the
    same order as ``tree_sum``: the same bits on leaves whose order of addition matters."""
    from apr.train.reduction import tree_sum_

    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 5, 8):
        leaves = [torch.randn(64, generator=g) * 10 ** (k % 4) for k in range(n)]
        expected = tree_sum([leaf.clone() for leaf in leaves])
        first = leaves[0]
        got = tree_sum_(leaves)
        assert got is first and torch.equal(got, expected)
