"""kill -9 in the middle of a rollback: while the checkpoint to go back to is being restored and
rewritten with the decision, and right after. Each time ``--resume latest``
ends bitwise equal to the uninterrupted rollback run, and the ledger lists the injected rows once."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.train.run_helpers import config_doc, run_until
from tests.train.test_survive import BAD, ROLLBACK_CFG, _corpus

WORKER = Path(__file__).resolve().parent / "run_worker.py"


def _env(root: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "APR_HOME": str(root / "home")}


def _cfg(root: Path) -> Path:
    doc = config_doc(root, data={"shuffle": False}, optimizer={"lr": 1e-2},
                     training={"max_steps": 30, "warmup_steps": 0, "lr_scheduler": "constant", "save_interval": 5,
                               "log_interval": 1, "eval_interval": 0, "grad_clip": None, **ROLLBACK_CFG})
    path = root / "cfg.json"
    path.write_text(json.dumps(doc))
    return path


def _run(cfg: Path, root: Path, resume: bool, kill_at: str | None = None) -> int:
    cmd = [sys.executable, str(WORKER), str(cfg)] + (["latest"] if resume else [])
    code, seen = run_until(cmd, _env(root), kill_at)
    if kill_at is not None:
        assert code == -signal.SIGKILL, f"ended ({code}) before {kill_at!r}: {seen[-5:]}"
    return code


def _final(root: Path) -> dict:
    return load_file(str(root / "run" / "checkpoint-step-30.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("full")
    _corpus(root)
    assert _run(_cfg(root), root, resume=False) == 0
    return _final(root)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [
    "step 23/30  rollback: ",  # deciding: restoring step 20, before its checkpoint is rewritten
    "step 23/30  rollback 1/3",  # the checkpoint rewritten and the event recorded
])
def test_kill_9_during_a_rollback_resumes_to_the_same_weights(tmp_path, uninterrupted, kill_at):
    _corpus(tmp_path)
    cfg = _cfg(tmp_path)
    _run(cfg, tmp_path, resume=False, kill_at=kill_at)
    assert _run(cfg, tmp_path, resume=True) == 0
    final = _final(tmp_path)
    assert all(final[k].equal(uninterrupted[k]) for k in uninterrupted)
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert state["status"] == "finished"
    rollbacks = [e for e in state["events"] if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and [r["row"] for r in rollbacks[0]["detail"]["rows"]] == list(BAD)
