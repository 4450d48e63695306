"""apr/memory/table.py: the budget searches use the leanest policy the config allows."""

from __future__ import annotations

from apr.memory.table import max_layers, total_bytes, with_layers
from apr.steps.execution import parse
from tests.train.tiny import make_config


def test_autograd_deepest_model_counts_keeping_every_graph_when_that_is_leaner():
    # one short sequence: every block's graph is smaller than the gradients that replace it in the
    # backward, so keeping them costs nothing at the peak while recompute's checkpoints do
    config = make_config(data={"batch_size": 1, "seq_len": 4}, training={"engine": "standard"})
    deep = with_layers(config, 6)
    keep, recompute = (total_bytes(deep, execution=parse(a, "kept", 6)) for a in ("keep", "recompute"))
    assert keep < recompute
    assert max_layers(config, keep) == 6
    # the walk's own buffers do not shrink when it keeps every graph: recompute stays its leanest
    walk = with_layers(make_config(data={"batch_size": 1, "seq_len": 4}), 6)
    assert total_bytes(walk, execution=parse("recompute", "workspace", 6)) < total_bytes(
        walk, execution=parse("keep", "workspace", 6))
