"""Objectives beyond the causal LM on two data-parallel ranks (CPU, gloo): custom targets (each rank's
rows carry their own targets beside their ids) and the masked LM, on DDP and FSDP2 full shards, equal
one process accumulating the same micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import VOCAB, make_dataset  # noqa: E402

from tests.distributed.ranks import two_ranks_against_one  # noqa: E402


def _add_targets(root: Path) -> None:
    """A ``targets`` column beside the ids: another token per position, every fifth ignored (-100)."""
    for shard in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(shard)
        ids = np.array(table.column("input_ids").to_pylist(), dtype=np.int64)
        targets = (ids * 7 + 3) % VOCAB
        targets[:, ::5] = -100
        width = ids.shape[1]
        offsets = pa.array(np.arange(0, (len(ids) + 1) * width, width, dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, pa.array(targets.reshape(-1).astype(np.int32)))
        pq.write_table(table.append_column("targets", column), shard)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])  # the layout in the id (apr/steps/composition.py)
def test_custom_targets_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=96)
    _add_targets(tmp_path)
    two_ranks_against_one(tmp_path, sharding, {"engine": "standard", "mode": "custom",
                                               "custom": {"targets_column": "targets"}})


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])  # the layout in the id (apr/steps/composition.py)
def test_the_masked_lm_on_two_ranks_equals_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    """training.mode: mlm: each row's mask comes from the seed, the step and its tokens, not its rank;
    its validation sum runs inside FSDP2's root forward (Engine.in_root). Under canonical reduction the
    validation rows and their sums do not depend on the ranks: the same validation losses, bitwise."""
    import json

    make_dataset(tmp_path, train_rows=96)
    two_ranks_against_one(tmp_path, sharding, {"engine": "standard", "mode": "mlm", "reduction": "canonical",
                                               "mlm": {"mask_rate": 0.25, "mask_token_id": 0}})
    got, want = (json.loads((tmp_path / d / "training_state.json").read_text())["val_loss_history"]
                 for d in ("two", "one"))
    assert [s for s, _ in got] == [s for s, _ in want] == [0, 3, 6]
    assert got == want
