"""Data parallelism on the CPU with gloo: K processes with per-rank batch b equal one with batch K*b."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.ranks import run_ranks, run_script  # noqa: E402

WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"


def _launch(doc: dict, path: Path, nproc: int, resume: str | None = None, code: int = 0,
            **env_extra: str) -> subprocess.CompletedProcess:
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120", **env_extra}
    if nproc > 1:  # the ranks as torchrun describes them, without its process (tests/distributed/ranks.py)
        proc = run_ranks(args, nproc, env, timeout=240)
    else:
        proc = run_script(args, env, timeout=240)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _final(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / f"checkpoint-step-{step}.safetensors"))


def _assert_close(a: dict, b: dict, rtol: float) -> None:
    assert set(a) == set(b)
    for name in a:
        if name.startswith("optimizer."):
            continue
        # relative difference of the whole tensor (Frobenius norms), as torch.testing measures closeness
        rel = ((a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-30)).item()
        assert rel <= rtol, f"{name}: relative difference {rel:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "accum", "clip_mode"), [
    ("interleaved", 1, "global"),
    ("interleaved", 2, "global"),
    ("interleaved", 1, "per_block"),
    ("standard", 2, "global"),
], ids=["ddp-interleaved-1-global", "ddp-interleaved-2-global", "ddp-interleaved-1-per_block",
        "ddp-standard-2-global"])  # the layout in the id (apr/steps/composition.py)
def test_two_ranks_equal_one_process_with_twice_the_batch(tmp_path, engine, accum, clip_mode):
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 10, "save_interval": 10, "eval_interval": 5, "engine": engine,
              "gradient_accumulation": accum, "grad_clip": 0.5, "clip_mode": clip_mode}
    # lr 3e-3: Adam turns summation-order rounding (one mean of 4 rows vs the mean of two means of 2) into
    # parameter differences that grow with the lr; at 1e-2 they reach ~1e-6 after 10 steps
    opt = {"lr": 3e-3, "min_lr": 3e-4}
    one = config_doc(tmp_path, data={"batch_size": 4}, optimizer=opt, training={**common, "output_dir": "one/"})
    two = config_doc(tmp_path, data={"batch_size": 2}, optimizer=opt, training={**common, "output_dir": "two/"})
    _launch(one, tmp_path / "one.json", 1)
    _launch(two, tmp_path / "two.json", 2)
    _assert_close(_final(tmp_path / "two", 10), _final(tmp_path / "one", 10), rtol=1e-6)
    state = json.loads((tmp_path / "two" / "training_state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 10
    # only rank 0 recorded: one run in the local store
    with sqlite3.connect(tmp_path / "two" / ".apr" / "experiments.db") as db:
        assert db.execute("select count(*) from runs").fetchone()[0] == 1


@pytest.mark.slow
def test_two_ranks_stopped_and_resumed_equal_an_uninterrupted_run(tmp_path):
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "save_interval": 4, "keep_last": 5, "eval_interval": 0}
    full = config_doc(tmp_path, data={"batch_size": 2}, training={**common, "max_steps": 10, "output_dir": "full/"})
    _launch(full, tmp_path / "full.json", 2)
    # the interrupted run: only its first 4 steps' checkpoint survives, then it resumes
    part = config_doc(tmp_path, data={"batch_size": 2}, training={**common, "max_steps": 10, "output_dir": "part/"})
    (tmp_path / "part").mkdir()
    for suffix in ("json", "safetensors"):
        src = tmp_path / "full" / f"checkpoint-step-4.{suffix}"
        (tmp_path / "part" / src.name).write_bytes(src.read_bytes())
    _launch(part, tmp_path / "part.json", 2, resume="latest")
    _assert_close(_final(tmp_path / "part", 10), _final(tmp_path / "full", 10), rtol=0.0)


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_a_stacked_run_with_a_qlora_trunk_grown_between_stages(tmp_path):
    make_dataset(tmp_path, train_rows=160)
    # stage 0 trains 2 blocks; the grow stores them in NF4 with rank-4 adapters under 2 new blocks on top
    # (prepend), so stage 1 trains adapters and dense blocks through DDP; a third stage adds the
    # progressive adapters to the then-trunk
    stacking = {"stages": [{"blocks": 2, "steps": 3}, {"blocks": 3, "steps": 3}, {"blocks": 4}],
                "building_mode": "prepend", "earlier": "freeze", "trunk_strategy": "qlora",
                "progressive_lora": {"rank": 2, "alpha": 4}}
    model = {"architecture": {"num_hidden_layers": 4}, "stacking": stacking}
    common = {"epochs": 1, "max_steps": 8, "save_interval": 8, "eval_interval": 0}
    opt = {"lr": 3e-3, "min_lr": 3e-4}  # as above: Adam's rounding differences stay ~1e-6 at this lr
    one = config_doc(tmp_path, model=model, data={"batch_size": 4}, optimizer=opt,
                     training={**common, "output_dir": "one/"})
    two = config_doc(tmp_path, model=model, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "output_dir": "two/"})
    _launch(one, tmp_path / "one.json", 1)
    _launch(two, tmp_path / "two.json", 2)
    got, want = _final(tmp_path / "two", 8), _final(tmp_path / "one", 8)
    codes = "model.layers.3.mlp.up_proj.weight.nf4.quantized_data"  # stage 0's block 1, now on top, in NF4
    assert codes in got and got[codes].equal(want[codes])  # every rank quantized the same weights alike
    assert got["model.layers.3.mlp.up_proj.lora_B_s2"].abs().sum() > 0  # the progressive adapter trained
    # The frozen NF4 trunk is identical on both sides; what differs is the summation order of the
    # trainable gradients' mean, as above (most tensors ~1e-6). rtol 1e-4: an adapter B that starts at
    # zero and trains 2 steps (block 1's, added to the trunk at step 7) is a sum of two Adam steps whose
    # elements with gradients near Adam's eps turn that rounding into ~4e-5 of its small norm (5e-3). An
    # adapter gradient not averaged across ranks would differ by ~1e-1.
    _assert_close(got, want, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "when", "at"), [
    (1, "compute", 3),  # before the loop looks at signals, on a step that is not a log step
    (0, "log", 5),  # during the step's hooks, after its logging
], ids=["ddp-rank1-compute-3", "ddp-rank0-log-5"])  # the layout in the id (apr/steps/composition.py)
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_its_checkpoint(tmp_path, rank, when, at):
    """A preempted node's SIGTERM may reach one rank before the others: every rank finishes the same
    step, rank 0 writes its checkpoint, every rank exits 143, and the run resumes from there. A rank
    that alone took the signal into account would log (a collective) or stop where the others go
    on, and the job would hang or fail."""
    make_dataset(tmp_path, train_rows=160)
    doc = config_doc(tmp_path, data={"batch_size": 2}, training={
        "epochs": 1, "max_steps": 8, "log_interval": 4, "save_interval": 100, "eval_interval": 0, "output_dir": "run/"})
    proc = _launch(doc, tmp_path / "cfg.json", 2, code=143, APR_TEST_SIGNAL=f"{rank}:{at}:{when}",
                   APR_DIST_TIMEOUT_S="60")
    assert "SIGTERM: finishing this step" in proc.stderr, proc.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert state["status"] == "stopped" and state["step"] == at and "SIGTERM" in state["status_reason"]
    assert state["last_checkpoint"]["step"] == at
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-step-*.json")) == [f"checkpoint-step-{at}.json"]
    if when == "compute":  # the stopped run resumes from that checkpoint (once: the other case stops alike)
        _launch(doc, tmp_path / "cfg.json", 2, resume="latest")
        state = json.loads((tmp_path / "run" / "training_state.json").read_text())
        assert state["status"] == "finished" and state["step"] == 8
