"""`apr train apply` through the CLI: plan first, plan files, refusals, exit codes, torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402


def _env() -> dict:
    """Read at call time, after the fixture has set a private APR_HOME."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}


def apr(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apr", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=_env())


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    return tmp_path


def test_plan_then_apply_the_saved_plan(root):
    cfg = write_config(root, training={"max_steps": 6})
    assert apr("train", "plan", str(cfg), "-out", "plan.json", cwd=root).returncode == 0
    proc = apr("train", "apply", "plan.json", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "finished" in proc.stdout and "steps 0 -> 6 of 6" in proc.stdout
    assert "Traceback" not in proc.stderr
    run = root / "run"
    assert json.loads((run / "plan.json").read_text())["config_hash"]
    assert json.loads((run / "training_state.json").read_text())["status"] == "finished"


def test_a_plan_with_errors_is_refused_before_anything_is_written(root):
    cfg = write_config(root, model={"architecture": {"num_attention_heads": 5}})
    proc = apr("train", "apply", str(cfg), cwd=root)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "C-ARCH-001" in proc.stderr and "cfg.yaml" in proc.stderr
    assert not (root / "run").exists()


def test_a_stale_plan_is_refused_with_what_changed(root):
    cfg = write_config(root, training={"max_steps": 6})
    assert apr("train", "plan", str(cfg), "-out", "plan.json", cwd=root).returncode == 0
    write_config(root, training={"max_steps": 6}, optimizer={"lr": 2e-3})
    proc = apr("train", "apply", "plan.json", cwd=root)
    assert proc.returncode == 1 and "stale" in proc.stderr and "optimizer.lr" in proc.stderr
    assert not (root / "run").exists()


def test_max_steps_beyond_the_data_is_caught_by_the_plan(root):
    cfg = write_config(root, training={"epochs": 1})  # 96 rows / 4 = 24 steps per epoch
    proc = apr("train", "apply", str(cfg), "--max-steps", "100", cwd=root)
    assert proc.returncode == 1 and "C-TRAINCFG-001" in proc.stderr and "24" in proc.stderr


def test_force_without_resume_is_refused(root):
    cfg = write_config(root, training={"max_steps": 2})
    proc = apr("train", "apply", str(cfg), "--force", cwd=root)
    assert proc.returncode == 1 and "--force only applies to a resume" in proc.stderr
    assert not (root / "run").exists()


def test_usage_errors_exit_2(root):
    assert apr("train", "apply", cwd=root).returncode == 2
    assert apr("train", "apply", "x.yaml", "--device", "tpu", cwd=root).returncode == 2


@pytest.mark.slow
def test_torchrun_two_processes_through_the_cli(root):
    cfg = write_config(root, training={"max_steps": 4, "eval_interval": 2})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "apr", "train", "apply", str(cfg)], cwd=root, capture_output=True, text=True,
                          timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("finished") == 1  # only rank 0 reports
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "finished" and state["total_steps"] == 4
    # 96 rows / (4 x 2 ranks) = 12 steps per epoch: the plan divided by the real world size
    plan = json.loads((root / "run" / "plan.json").read_text())
    assert plan["facts"]["steps"]["steps_per_epoch"] == 12
