"""Custom targets on two data-parallel ranks (CPU, gloo): each rank's rows carry their own targets
beside their ids, so DDP's all-reduce equals one process accumulating the same micro-batches."""

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
@pytest.mark.parametrize("sharding", ["none"])  # the layout in the id (apr/steps/composition.py)
def test_custom_targets_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=96)
    _add_targets(tmp_path)
    two_ranks_against_one(tmp_path, sharding, {"engine": "standard", "mode": "custom",
                                               "custom": {"targets_column": "targets"}})
