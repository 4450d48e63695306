"""What ``training.reduction: canonical`` holds and moves beside ``fast``, per rank and step
(apr/train/reduction.py; docs/design.md, "Canonical reduction"). Torch-free: the memory table counts
it as a row (``canonical_leaves``) and the plan prints it at ``training.reduction``
(apr/plan/reductionfacts.py).

One process: the micro-batches' gradient leaves (the tree sums in place: the mean is the first). On
several ranks, at the peak of the all-to-alls (one per accumulation index, each local leaf freed once
sent): the last local leaf and this rank's slice of every global micro-batch (one slice per rank
replicated or under full; a shard's rows times the replicas under hybrid, where every replica of a
shard receives them, plus the copy being sent); then the mean's slices all-gathered whole (for the
norms on FSDP2, after those are freed; replicated, for the update, counted beside the received rows:
`apr train plan --trace` finds them alive together).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CanonicalBytes:
    leaves: int  # micro-batch gradients summed in the tree a step (world_size x accumulation)
    extra: int  # bytes held beyond fast, per rank, at the peak
    sent: int  # bytes a rank sends a step
    fast_sent: int  # bytes fast's all-reduce (or reduce-scatter) sends a step
    copied: int  # bytes canonical's copies write (leaves, slices, the mean)
    all_to_alls: int  # collectives a step: all-to-alls, then one all-gather (none on one process)


def canonical_bytes(config, param_bytes: int, world_size: int) -> CanonicalBytes:
    """Canonical's cost for one gradient of ``param_bytes`` on ``world_size`` ranks (see the module docstring)."""
    tr = config.training
    accum = int(tr.gradient_accumulation)
    if world_size == 1:  # the leaves, summed in place (the mean is the first); written, then read by the tree
        return CanonicalBytes(accum, accum * param_bytes, 0, 0, 2 * accum * param_bytes, 0)
    sharded = str(tr.sharding) != "none"
    nodes = int(tr.nodes)
    group = world_size // nodes if str(tr.sharding) == "hybrid" and world_size % nodes == 0 else world_size
    replicas = world_size // group
    moved = accum * replicas * param_bytes  # what the all-to-alls receive (and send) in all
    extra = max(accum, 1 + moved // param_bytes + (replicas if replicas > 1 else 0)) * param_bytes
    if not sharded:  # replicated: the mean's slices gathered and joined (2 gradients) and this rank's slice,
        # counted beside the received rows (``apr train plan --trace`` finds them alive together)
        extra = moved + 2 * param_bytes + param_bytes // world_size
    sent = moved * (world_size - 1) // world_size + param_bytes * (group - 1) // group
    fast_sent = (1 if sharded else 2) * param_bytes * (world_size - 1) // world_size  # reduce-scatter; ring
    copied = (3 * accum + 2) * param_bytes  # the leaves written, sent and summed; the mean gathered, written
    return CanonicalBytes(accum * world_size, extra, sent, fast_sent, copied, accum)
