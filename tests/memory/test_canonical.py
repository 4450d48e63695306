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
    # its slices of 8 leaves (2 gradients), then the mean's slices gathered and joined (2) and its own (1/4)
    (4, "none", 1, 2 * G + 2 * G + G // 4, (2 * G + G) * 3 // 4),
    (4, "full", 1, 3 * G, (2 * G + G) * 3 // 4),
    (4, "hybrid", 2, (1 + 2 * 2 + 2) * G, 2 * 2 * G * 3 // 4 + G // 2),  # shards' rows to both replicas
])
def test_the_peak_and_the_bytes_sent_follow_the_layout(world, sharding, nodes, extra, sent):
    config = make_config(training={"engine": "standard", "reduction": "canonical", "gradient_accumulation": 2,
                                   "world_size": world, "sharding": sharding, "nodes": nodes})
    cost = canonical_bytes(config, G, world)
    assert (cost.leaves, cost.extra, cost.sent) == (2 * world, extra, sent)
    assert cost.all_to_alls == (0 if world == 1 else 2)


def test_the_memory_table_holds_what_the_leaves_add_at_the_steps_peak_only_under_canonical():
    """The row is the larger of the leaves beside the last backward's activations and the sum's peak
    beyond what the activations and loss chunks (and autograd's own .grad) held; never more than the
    sum's peak, and absent under fast."""
    rows = {}
    for engine in ("interleaved", "standard"):
        for accum in (1, 4):
            config = make_config(training={"engine": engine, "reduction": "canonical", "world_size": 2,
                                           "gradient_accumulation": accum})
            grad = 4 * trainable_param_count(config)
            table = {r.component: r.bytes for r in memory_table(config)}
            rows[engine, accum] = table["canonical_leaves"]
            assert table["canonical_leaves"] <= canonical_bytes(config, grad, 2).extra
            if engine == "interleaved":  # the walk's kept buffers stay: 3 earlier leaves beside the last backward
                assert table["canonical_leaves"] >= (accum - 1) * grad
    assert rows["standard", 4] <= rows["interleaved", 4]  # autograd's .grad moves into its leaf
    fast = make_config(training={"engine": "interleaved", "world_size": 2})
    assert "canonical_leaves" not in [r.component for r in memory_table(fast)]
