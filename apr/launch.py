"""What a launcher (torchrun) told this process about its job: how many ranks, how many per node.
Torch-free, so ``apr train apply`` plans (and refuses a bad config) before it imports torch."""

from __future__ import annotations

import os


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def env_ranks_per_node(world: int) -> int | None:
    """Ranks on each node: torchrun's LOCAL_WORLD_SIZE (``APR_SHARD_GROUP_SIZE`` overrides it, e.g.
    to test hybrid sharding on one machine); ``world`` when neither is set; None when unreadable."""
    try:
        return int(os.environ.get("APR_SHARD_GROUP_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or world)
    except ValueError:
        return None


def env_nodes(world: int) -> int:
    """The hosts ``world`` ranks run on (world / ranks per node); 1 when unknown or uneven."""
    per_node = env_ranks_per_node(world)
    return world // per_node if per_node is not None and per_node >= 1 and world % per_node == 0 else 1
