"""apr/memory/canonical.py: what training.reduction: canonical holds and sends beside fast, per rank, and
its row in the memory table (so the budget, the policy choice and --fit count it)."""

from __future__ import annotations

import pytest

from apr.memory.canonical import canonical_bytes
from apr.memory.table import memory_table
from apr.model.spec import trainable_param_count
from tests.train.tiny import make_config

G = 2**20  # one gradient's bytes


@pytest.mark.parametrize(("world", "sharding", "nodes", "extra", "sent"), [
    (1, "none", 1, 2 * G, 0),  # one process x 2: both leaves (the tree sums in place)
    (4, "none", 1, 3 * G, (2 * G + G) * 3 // 4),  # its slices of 8 leaves (2 gradients) + the last local leaf
    (4, "full", 1, 3 * G, (2 * G + G) * 3 // 4),
    (4, "hybrid", 2, (1 + 2 * 2 + 2) * G, 2 * 2 * G * 3 // 4 + G // 2),  # shards' rows to both replicas
])
def test_the_peak_and_the_bytes_sent_follow_the_layout(world, sharding, nodes, extra, sent):
    config = make_config(training={"engine": "standard", "reduction": "canonical", "gradient_accumulation": 2,
                                   "world_size": world, "sharding": sharding, "nodes": nodes})
    cost = canonical_bytes(config, G, world)
    assert (cost.leaves, cost.extra, cost.sent) == (2 * world, extra, sent)
    assert cost.all_to_alls == (0 if world == 1 else 2)


def test_the_memory_table_holds_the_leaves_beside_the_gradients_only_under_canonical():
    canonical = make_config(training={"engine": "interleaved", "reduction": "canonical", "world_size": 2})
    fast = make_config(training={"engine": "interleaved", "world_size": 2})
    components = [r.component for r in memory_table(canonical)]
    assert components.index("canonical_leaves") == components.index("gradients") + 1
    row = next(r for r in memory_table(canonical) if r.component == "canonical_leaves")
    assert row.bytes == canonical_bytes(canonical, 4 * trainable_param_count(canonical), 2).extra
    assert "canonical_leaves" not in [r.component for r in memory_table(fast)]
