"""Orchestration under DDP and under FSDP2 sharding (gloo, 2 CPU ranks): every rank makes the same
decisions, because the rewards are validation sums and losses averaged over the ranks; the 2-rank
run equals one process with twice the batch, decisions included. On shards each rank snapshots
and restores its own rows of the weights and moments (nothing gathered)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.test_data_parallel import _assert_close, _launch  # noqa: E402
from tests.distributed.test_sharding import _weights  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])
def test_two_ranks_decide_alike_and_equal_one_process_with_twice_the_batch(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 10, "save_interval": 10, "eval_interval": 5, "grad_clip": 0.5,
              "orchestrator": {"enabled": True, "decision_interval": 4, "eval_horizon": 2, "branches": 2,
                               "candidates": ["conservative_adamw", "aggressive_adamw", "spike_resistant"],
                               # a nowcast branch too: on shards it extrapolates each rank's rows
                               "nowcasting": {"enabled": sharding == "full"}}}
    opt = {"lr": 3e-3, "min_lr": 3e-4}
    one = config_doc(tmp_path, data={"batch_size": 4}, optimizer=opt, training={**common, "output_dir": "one/"})
    two = config_doc(tmp_path, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "output_dir": "two/", "sharding": sharding})
    _launch(one, tmp_path / "one.json", 1)
    _launch(two, tmp_path / "two.json", 2)
    history = {name: json.loads((tmp_path / name / "checkpoint-step-10.json").read_text())["orchestrator"]["history"]
               for name in ("one", "two")}  # the checkpoint's orchestrator part: rank 0's decisions
    assert [d["winner"] for d in history["two"]] == [d["winner"] for d in history["one"]]
    assert len(history["two"]) == 2 and [b["strategy"] for b in history["two"][1]["branches"]] == \
        [b["strategy"] for b in history["one"][1]["branches"]]
    if sharding == "full":
        assert [d["nowcast"] is not None for d in history["two"]] == [d["nowcast"] is not None
                                                                       for d in history["one"]]
    # a rank that chose otherwise would have stepped other weights into the all-reduced sums
    _assert_close(_weights(tmp_path / "two", 10), _weights(tmp_path / "one", 10), rtol=1e-5)
