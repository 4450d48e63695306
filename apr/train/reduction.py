"""``training.reduction: canonical``: a gradient sum that does not depend on the world size
(docs/design.md, "Canonical reduction").

A step's global batch is N = world_size x gradient_accumulation micro-batches. The data loader gives
global micro-batch ``j = k * world_size + rank`` (``k``: the rank's accumulation index) the same rows
whatever the layout (``ShardLoader``: position ``k`` reads ``batch_size x world_size`` rows, rank
``r`` the ``r``-th slice; an elastic resume keeps ``batch_size`` and scales the cursor), so leaf ``j``
is the same micro-batch on 1, 2 or 4 ranks. Each micro-batch's gradient is kept apart (one flat
float32 leaf, not accumulated into ``.grad``) and the leaves are added in one fixed binary tree over
``j`` (``tree_sum``), then divided by N: the same float operations in the same order on any layout,
so 1, 2 and 4 ranks, and one process with accumulation, give the same bits. On several ranks each
rank sums one slice of every leaf (an all-to-all per accumulation index hands it its slice of every
global micro-batch) and the mean's slices are all-gathered: addition is element-wise, so a slice of
the tree's sum is the same bits whatever the slicing. The step's loss is the same tree over the
leaves' losses.

The cost (shown by the plan): the rank's own leaves, then its slice of all N (about one gradient),
then the gathered mean, where ``fast`` holds one gradient; and all-to-alls plus one all-gather where
``fast`` all-reduces one gradient.

On FSDP2 shards (``ShardedCanonicalSum``, used by apr/train/sharded.py) a rank never needs the other
shards' rows of the sum: each micro-batch's whole gradient stays on the rank that computed it (FSDP2
does not reduce-scatter it), laid out as one padded bucket per shard; an all-to-all per accumulation
index hands every rank its shard's bucket of every global micro-batch, which it sums in the same tree. Addition is
element-wise, so a shard's rows of the tree's sum are bitwise the rows of the whole sum one process
takes, whatever the shards' boundaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # loaded by `import torch` anyway


def _tree(leaves: list[torch.Tensor], add) -> torch.Tensor:
    """``add`` over ``leaves`` in the fixed binary tree over their indices: ``[lo, hi)`` splits at
    ``lo + (hi - lo + 1) // 2``; the shape of the tree depends on the number of leaves only."""
    def node(lo: int, hi: int) -> torch.Tensor:
        if hi - lo == 1:
            return leaves[lo]
        mid = lo + (hi - lo + 1) // 2
        return add(node(lo, mid), node(mid, hi))

    if not leaves:
        raise ValueError("tree_sum of no leaves")
    return node(0, len(leaves))


def tree_sum(leaves: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``leaves`` in the fixed tree (``_tree``); the leaves are left as they were."""
    return _tree(leaves, lambda a, b: a + b)


def tree_sum_(leaves: list[torch.Tensor]) -> torch.Tensor:
    """``tree_sum`` in place: each node's sum is added into its left subtree's first leaf (``a.add_(b)``
    is the same float operation as ``a + b``, so the bits are ``tree_sum``'s) and returned in
    ``leaves[0]``; no temporaries, and the leaves hold partial sums afterwards."""
    return _tree(leaves, lambda a, b: a.add_(b))


class CanonicalSum:
    """Collects one step's micro-batch gradients and losses and reduces them canonically. On several
    ranks each leaf is cut into one slice per rank (padded to ``world x ceil(numel / world)``): an
    all-to-all per accumulation index gives every rank its slice of every global micro-batch, which it
    sums in the tree; the slices of the mean are then all-gathered. Addition is element-wise, so the
    slices' sums are the whole tree's bits, and a rank receives about one gradient where gathering
    every leaf whole would cost ``world x accumulation`` (``ShardedCanonicalSum`` with one shard per rank)."""

    def __init__(self, dp):
        self.dp = dp  # apr.train.dist.DataParallel, or None for one process
        self.world = 1 if dp is None else dp.world_size
        self.numel = 0
        self.leaves: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []

    def take(self, grads: list[torch.Tensor], loss: torch.Tensor) -> None:
        """One micro-batch's gradients (flattened into a leaf of their own, padded to a multiple of the
        world size) and its mean loss."""
        self.numel = sum(g.numel() for g in grads)
        leaf = torch.empty(-(-self.numel // self.world) * self.world, dtype=torch.float32, device=grads[0].device)
        offset = 0
        for g in grads:  # each copied into its slice (a bf16 gradient is cast there: no float32 copy beside)
            leaf[offset:offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        leaf[self.numel:].zero_()
        self.leaves.append(leaf)
        self.losses.append(loss.detach().float().reshape(1))

    def reduce(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean gradient (flat) and the mean loss over the global batch; clears the step."""
        leaves, losses = self.leaves, self.losses
        self.leaves, self.losses = [], []
        if self.world == 1:  # summed in the leaves themselves: the mean is the first leaf
            n = len(leaves)
            return tree_sum_(leaves).div_(n), (tree_sum(losses) / n).reshape(())
        split = ShardedCanonicalSum(self.dp, self.world)  # one shard per rank: rank r sums slice r
        split.leaves, split.losses = [leaf.view(self.world, -1) for leaf in leaves], losses
        del leaves
        row, loss = split.reduce()
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row)
        return torch.cat(rows)[:self.numel], loss


def in_global_order(dp, local: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's ``local`` leaves in global micro-batch order ``j = k * world + rank`` (a collective)."""
    if dp is None:
        return local
    gathered = []
    for leaf in local:  # one all-gather per accumulation index: rank r's k-th leaf is j = k * world + r
        parts = [torch.empty_like(leaf) for _ in range(dp.world_size)]
        dist.all_gather(parts, leaf)
        gathered += parts
    return gathered


class ShardedCanonicalSum:
    """The canonical sum on FSDP2 shards: each micro-batch's whole gradient as ``[shards, B]`` (row
    ``s``: shard ``s``'s rows of every parameter, padded to FSDP2's chunk of ``ceil(rows / shards)``
    rows), and all-to-alls that give this rank its shard's row of every global micro-batch's."""

    def __init__(self, dp, shards: int):
        self.dp, self.shards = dp, shards  # shards: ranks in a shard group (hybrid: a node's; full: all)
        self.leaves: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []

    def take(self, leaf: torch.Tensor, loss: torch.Tensor) -> None:
        self.leaves.append(leaf)
        self.losses.append(loss.detach().float().reshape(1))

    def reduce(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard's bucket of the mean gradient over the global batch, and the mean loss;
        clears the step. Rank ``q`` holds shard ``q % shards`` (FSDP2's mesh: replicas outermost). One
        all-to-all per accumulation index ``k``, each micro-batch freed once sent: what this rank receives
        from rank ``q`` is its shard's row of global micro-batch ``j = k * world + q``."""
        world = self.dp.world_size
        pick = None if self.shards == world else [q % self.shards for q in range(world)]  # hybrid: to every replica
        received = []
        for k, leaf in enumerate(self.leaves):
            self.leaves[k] = None
            send = leaf if pick is None else leaf[pick]
            part = torch.empty((world, leaf.shape[1]), dtype=leaf.dtype, device=leaf.device)
            dist.all_to_all_single(part, send)
            del leaf, send
            received.append(part)
        self.leaves = []
        leaves = [row for part in received for row in part.unbind(0)]  # in j order
        losses = in_global_order(self.dp, self.losses)
        self.losses = []
        n = len(leaves)  # summed in place in the received rows, which are freed on return (the mean is new)
        return tree_sum_(leaves) / n, (tree_sum(losses) / n).reshape(())


def agreed(dp, value: torch.Tensor, canonical: bool) -> torch.Tensor:
    """A step's figure (its loss, a stack of losses) as every rank takes it for a decision: under
    ``fast`` the mean of the ranks' own figures (an all-reduce, in an order of the backend's); under
    ``canonical`` the figure as it is, already the tree's over the global batch and the same bits on
    every rank (averaging equal values over 3 or more ranks can round: ``(x + x) + x`` need not be
    ``3x``). A copy: ``value`` is left as it was."""
    value = value.detach().clone()
    return value if canonical or dp is None else dp.average_(value)


def canonical_sums(dp, local: list[torch.Tensor], count: int) -> torch.Tensor:
    """The tree sum of ``count`` values spread over the ranks, value ``j`` on rank ``j % world`` as its
    ``j // world``-th entry of ``local`` (a rank may hold one entry more than it needs: padding, never
    summed); every rank gets the same bits (a collective). Validation's per-micro-batch loss sums."""
    ordered = in_global_order(dp, local)  # position i * world + q: rank q's i-th entry, value j = i * world + q
    return tree_sum(ordered[:count])
