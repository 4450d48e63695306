"""training.reduction: canonical (apr/train/reduction.py) across layouts on gloo: 2 ranks with accumulation 2,
one process with accumulation 4, and a 2-rank run resumed on one process end with the same bits."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.ranks import run_ranks, run_script  # noqa: E402

WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"


def _launch(doc: dict, path: Path, nproc: int, resume: str | None = None) -> None:
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120"}
    proc = run_ranks(args, nproc, env, timeout=240) if nproc > 1 else run_script(args, env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / f"checkpoint-step-{step}.safetensors"))


def _bitwise(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("clip_mode", ["global"], ids=["ddp-standard-global"])  # the layout in the id
def test_two_ranks_one_process_and_a_resume_on_fewer_ranks_end_bitwise_equal(tmp_path, clip_mode):
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 8, "save_interval": 4, "keep_last": 5, "eval_interval": 0,
              "engine": "standard", "reduction": "canonical", "grad_clip": 0.5, "clip_mode": clip_mode}
    opt = {"lr": 1e-2, "min_lr": 1e-3}  # an lr at which fast's rank-dependent rounding shows by step 8

    def doc(out: str, accum: int) -> dict:
        return config_doc(tmp_path, data={"batch_size": 2}, optimizer=opt,
                          training={**common, "gradient_accumulation": accum, "output_dir": out})

    _launch(doc("two/", 2), tmp_path / "two.json", 2)  # global micro-batches j = k * 2 + rank
    _launch(doc("one/", 4), tmp_path / "one.json", 1)  # the same 4 micro-batches a step, j = k
    _bitwise(_state(tmp_path / "one", 8), _state(tmp_path / "two", 8))
    # the 2-rank run killed after its step-4 checkpoint, resumed on one process (elastic: accumulation 4)
    (tmp_path / "resumed").mkdir()
    for suffix in ("json", "safetensors"):
        shutil.copy(tmp_path / "two" / f"checkpoint-step-4.{suffix}", tmp_path / "resumed")
    _launch(doc("resumed/", 2), tmp_path / "resumed.json", 1, resume="latest")
    _bitwise(_state(tmp_path / "resumed", 8), _state(tmp_path / "two", 8))
