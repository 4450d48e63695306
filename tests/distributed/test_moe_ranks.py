"""The mixture of experts on two data-parallel ranks (CPU, gloo): DDP's all-reduce and FSDP2 shards
(each block's experts in the block's unit) equal one process accumulating the same micro-batches,
whose balance loss, like each rank's, is computed over its own micro-batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset  # noqa: E402

from tests.distributed.ranks import two_ranks_against_one  # noqa: E402

MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 32, "balance_loss_coef": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])  # the layout in the id (apr/steps/composition.py)
def test_experts_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=96)
    a, _ = two_ranks_against_one(tmp_path, sharding, {"engine": "standard"}, model={"architecture": {"moe": MOE}})
    assert any(".mlp.experts.gate_up_proj" in k for k in a)
    # the step's routing figures, averaged over the ranks: the one process's over its micro-batches
    got, want = (json.loads((tmp_path / d / "training_state.json").read_text())["moe"] for d in ("two", "one"))
    assert got["step"] == want["step"] == 6
    assert got["moe_balance_loss"] == pytest.approx(want["moe_balance_loss"], rel=1e-5)
    assert got["moe_expert_load"] == pytest.approx(want["moe_expert_load"], rel=1e-5)
