"""Time conditioning on two data-parallel ranks (CPU, gloo): each row's time step depends on the
seed, the step and its tokens only, so DDP's all-reduce and FSDP2's shards (the time embedding in
the root unit with the token embedding) equal one process accumulating the same micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset  # noqa: E402

from tests.distributed.ranks import two_ranks_against_one  # noqa: E402

TIME = {"embedding_dim": 8, "num_time_steps": 16, "encoding": "learned"}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])  # the layout in the id (apr/steps/composition.py)
def test_time_steps_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=96)
    a, _ = two_ranks_against_one(tmp_path, sharding, {"engine": "standard"}, model={"architecture": {"time": TIME}})
    assert "model.time_embedding.table.weight" in a
