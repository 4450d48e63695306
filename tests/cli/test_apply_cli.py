"""`apr train apply` through the CLI: plan first, plan files, refusals, exit codes, torchrun."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
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


def _records_status(root: Path) -> list[str]:
    """The run's last status in the state file and in both stores."""
    import sqlite3

    out = [json.loads((root / "run" / "training_state.json").read_text())["status"]]
    for db in (root / "run" / ".apr" / "experiments.db", Path(os.environ["APR_HOME"]) / "experiments.db"):
        conn = sqlite3.connect(db)
        out.append(conn.execute("SELECT status FROM runs").fetchone()[0])
        conn.close()
    return out


# `apr ARGS` with SIGHUP at its default, as at a terminal: a suite started under nohup (a CI job, a
# background `make test`) passes an ignored SIGHUP on, and apr rightly leaves an ignored SIGHUP alone.
_AS_AT_A_TERMINAL = ("import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
                     "from apr.cli.entry import run; sys.argv = ['apr', *sys.argv[1:]]; run()")


def _start_piped(root: Path, cfg: Path) -> subprocess.Popen:
    """apply with stdout and stderr into one pipe (as `2>&1 | tee log`), in its own process group.
    The pipe holds one page (Linux's default is 64 KiB, ~600 step lines): a run whose reader stops
    reading waits in a write a few steps later, instead of training on (CPU the suite pays for) or
    ending before the test's signal reaches it."""
    proc = subprocess.Popen([sys.executable, "-c", _AS_AT_A_TERMINAL, "train", "apply", str(cfg)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # before the interpreter's first write
    return proc


def _read_until_step(proc: subprocess.Popen, step: int) -> None:
    for line in proc.stdout:
        if line.startswith("step ") and "loss" in line and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError(f"apply ended ({proc.wait()}) before step {step}")


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_after_the_pipe_reader_died_still_checkpoints_and_records_stopped(root, sig, code):
    # Ctrl-C on `apr train apply cfg.yaml 2>&1 | tee log`: the group gets SIGINT and tee dies first
    cfg = write_config(root, training={"epochs": 20, "max_steps": 400, "log_interval": 1, "save_interval": 1000,
                                       "eval_interval": 0})
    proc = _start_piped(root, cfg)
    try:
        _read_until_step(proc, 2)
        proc.stdout.close()  # the reader is gone: apr's next write meets EPIPE
        os.killpg(proc.pid, sig)
        assert proc.wait(timeout=120) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert _records_status(root) == ["stopped"] * 3
    assert sig.name in state["status_reason"] and "BrokenPipe" not in state["status_reason"]
    step = state["last_checkpoint"]["step"]
    assert 2 <= step < 400 and (root / "run" / f"checkpoint-step-{step}.json").is_file()


@pytest.mark.slow
def test_a_reader_that_goes_away_without_a_signal_does_not_stop_the_run(root):
    cfg = write_config(root, training={"max_steps": 10, "log_interval": 1, "eval_interval": 0})
    proc = _start_piped(root, cfg)
    try:
        _read_until_step(proc, 1)
        proc.stdout.close()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _records_status(root) == ["finished"] * 3
    assert (root / "run" / "checkpoint-step-10.json").is_file()


@pytest.mark.slow
def test_a_second_apply_on_a_busy_output_dir_is_refused_and_kill_9_frees_it(root):
    # a long run; once its unread pipe is full it waits in a write, still holding the folder
    cfg = write_config(root, training={"epochs": 5000, "max_steps": 100_000, "log_interval": 1,
                                       "save_interval": 100_000, "eval_interval": 0})
    first = _start_piped(root, cfg)
    try:
        _read_until_step(first, 1)
        for extra in ([], ["--resume", "latest"]):
            second = apr("train", "apply", str(cfg), *extra, cwd=root)
            assert second.returncode == 1 and "Traceback" not in second.stderr
            assert f"in use by another apr run (pid {first.pid} on host {socket.gethostname()}" in second.stderr
        assert first.poll() is None  # the first run goes on
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    # no lock outlives its process: a new run into the folder (no checkpoint was written) starts
    cfg = write_config(root, training={"max_steps": 3, "eval_interval": 0})
    proc = apr("train", "apply", str(cfg), cwd=root)
    assert proc.returncode == 0, proc.stderr
