"""``training.reduction: canonical``: a gradient sum that does not depend on the world size
(docs/design.md, "Canonical reduction").

A step's global batch is N = world_size x gradient_accumulation micro-batches. The data loader gives
global micro-batch ``j = k * world_size + rank`` (``k``: the rank's accumulation index) the same rows
whatever the layout (``ShardLoader``: position ``k`` reads ``batch_size x world_size`` rows, rank
``r`` the ``r``-th slice; an elastic resume keeps ``batch_size`` and scales the cursor), so leaf ``j``
is the same micro-batch on 1, 2 or 4 ranks. Each micro-batch's gradient is kept apart (one flat
float32 leaf, not accumulated into ``.grad``), every rank gathers every leaf in ``j`` order, and the
leaves are added in one fixed binary tree over ``j`` (``tree_sum``), then divided by N: the same
float operations in the same order on any layout, so 1, 2 and 4 ranks, and one process with
accumulation, give the same bits. The step's loss is the same tree over the leaves' losses.

The cost (shown by the plan): N leaves of the model's gradient on every rank (the local ones, then
the gathered ones) where ``fast`` holds one, and an all-gather of N gradients where ``fast``
all-reduces one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # loaded by `import torch` anyway


def tree_sum(leaves: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``leaves`` in the fixed binary tree over their indices: ``[lo, hi)`` splits at
    ``lo + (hi - lo + 1) // 2``; the shape of the tree depends on the number of leaves only."""
    def node(lo: int, hi: int) -> torch.Tensor:
        if hi - lo == 1:
            return leaves[lo]
        mid = lo + (hi - lo + 1) // 2
        return node(lo, mid) + node(mid, hi)

    if not leaves:
        raise ValueError("tree_sum of no leaves")
    return node(0, len(leaves))


class CanonicalSum:
    """Collects one step's micro-batch gradients and losses and reduces them canonically."""

    def __init__(self, dp):
        self.dp = dp  # apr.train.dist.DataParallel, or None for one process
        self.leaves: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []

    def take(self, grads: list[torch.Tensor], loss: torch.Tensor) -> None:
        """One micro-batch's gradients (flattened into a leaf of their own) and its mean loss."""
        self.leaves.append(torch.cat([g.reshape(-1).float() for g in grads]))
        self.losses.append(loss.detach().float().reshape(1))

    def _ordered(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's ``local`` leaves in global micro-batch order ``j = k * world + rank``."""
        if self.dp is None:
            return local
        world = self.dp.world_size
        gathered = []
        for leaf in local:  # one all-gather per accumulation index: rank r's k-th leaf is j = k * world + r
            parts = [torch.empty_like(leaf) for _ in range(world)]
            dist.all_gather(parts, leaf)
            gathered += parts
        return gathered

    def reduce(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean gradient (flat) and the mean loss over the global batch; clears the step."""
        leaves, losses = self._ordered(self.leaves), self._ordered(self.losses)
        self.leaves, self.losses = [], []
        n = len(leaves)
        return tree_sum(leaves) / n, (tree_sum(losses) / n).reshape(())
