"""training.reduction: canonical across world sizes (issue 50's numbers, on gloo): 4 ranks equal one
process with accumulation 4 bitwise, and a checkpoint of either resumes on another number of ranks
(4 -> 2, 4 -> 1, 1 -> 4) to the uninterrupted run's bits, on DDP and on FSDP2 full and hybrid
(shard groups of 2 ranks). benchmarks/check_canonical_ranks.py runs the same at 8 steps with more
features; tests/distributed/test_canonical.py covers 2 ranks with each clip mode."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.ranks import run_ranks, run_script  # noqa: E402
from tests.distributed.test_canonical import _bitwise, _state, _val_losses  # noqa: E402

WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"


def _launch(doc: dict, path: Path, nproc: int, resume: str | None = None) -> None:
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120", "APR_SHARD_GROUP_SIZE": "2"}
    proc = run_ranks(args, nproc, env, timeout=300) if nproc > 1 else run_script(args, env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "sharding"), [("standard", "none"), ("standard", "full"), ("standard", "hybrid"),
                                                  ("interleaved", "none"), ("interleaved", "full"),
                                                  ("interleaved", "hybrid")])
def test_four_ranks_one_process_and_resumes_across_world_sizes_end_bitwise_equal(tmp_path, engine, sharding):
    make_dataset(tmp_path, train_rows=160)
    # 4 validation micro-batches: one per rank on 4, all four on one process
    common = {"epochs": 1, "max_steps": 4, "save_interval": 2, "keep_last": 3, "eval_interval": 2,
              "eval_batches": 4, "engine": engine, "reduction": "canonical", "grad_clip": 0.5,
              "sharding": sharding}

    def doc(out: str, accum: int) -> dict:
        return config_doc(tmp_path, data={"batch_size": 2}, optimizer={"lr": 1e-2, "min_lr": 1e-3},
                          training={**common, "gradient_accumulation": accum, "output_dir": out})

    _launch(doc("four/", 1), tmp_path / "four.json", 4)
    _launch(doc("one/", 4), tmp_path / "one.json", 1)
    _bitwise(_state(tmp_path / "four", 4), _state(tmp_path / "one", 4))
    assert _val_losses(tmp_path / "four") == _val_losses(tmp_path / "one")
    # the logged step losses too: the tree's loss as it is, never re-averaged over the ranks
    logged = [json.loads((tmp_path / d / "training_state.json").read_text())["loss_history"] for d in ("four", "one")]
    assert logged[0] == logged[1] and len(logged[0]) > 1
    # each resume reads the step-2 checkpoint of a run on another number of ranks (its accumulation
    # follows from the checkpoint's global batch: the elastic resume) and ends at that run's bits
    for target, ranks, accum, source in (("r2", 2, 1, "four"), ("r1", 1, 1, "four"), ("r4", 4, 4, "one")):
        (tmp_path / target).mkdir()
        for path in (tmp_path / source).glob("checkpoint-step-2.*"):  # the JSON and the weights (or parts)
            shutil.copy(path, tmp_path / target)
        _launch(doc(f"{target}/", accum), tmp_path / f"{target}.json", ranks, resume="latest")
        _bitwise(_state(tmp_path / target, 4), _state(tmp_path / source, 4))
