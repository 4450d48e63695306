"""`apr sweep` through the CLI: bad input exits 1 before any trial, naming the file, key and line;
two workers share one storage; a killed sweep resumes its trial exactly; the best trial's config
trains to the same metric bitwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from apr.cli.main import app

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402

runner = CliRunner()


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}


def apr(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apr", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=_env())


@pytest.fixture
def root(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    write_config(tmp_path, training={"max_steps": 3, "warmup_steps": 1, "eval_interval": 3, "save_interval": 3})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _json(*args: str) -> dict:
    """`apr sweep status|best ... --json`, in this process (a subprocess costs seconds of imports)."""
    result = runner.invoke(app, ["sweep", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _sweep(root: Path, text: str) -> Path:
    path = root / "sweep.yaml"
    path.write_text(text.lstrip("\n"))
    return path


@pytest.mark.parametrize("text, path, line", [
    ("config: cfg.yaml\nmethod: grid\nparameters:\n  optimizer.lrr: {values: [0.1]}\n", "parameters.optimizer.lrr", 4),
    ("config: cfg.yaml\nmethod: random\nrun_cap: 2\nparameters:\n  optimizer.lr: {min: 0.1, max: 0.01}\n",
     "parameters.optimizer.lr.min", 5),
    ("config: cfg.yaml\nmethod: grid\nmetric: {name: accuracy}\nparameters:\n  optimizer.lr: {value: 0.1}\n",
     "metric.name", 3),
    ("config: cfg.yaml\nmethod: grid\nparameters:\n  optimizer.lr: {values: [0.01, -1]}\n",
     "parameters.optimizer.lr.values.1", 4),
])
def test_bad_sweep_files_exit_1_before_any_trial(root, text, path, line):
    sweep = _sweep(root, text)
    for command in ("run", "plan"):
        result = runner.invoke(app, ["sweep", command, str(sweep)])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert f"sweep.yaml:{line}:" in result.output and path in result.output
    assert not (root / "sweeps").exists()


def test_a_storage_that_cannot_be_opened_exits_1_before_any_trial(root):
    sweep = _sweep(root, "config: cfg.yaml\nmethod: grid\nparameters:\n  optimizer.lr: {values: [0.01]}\n")
    (root / "foreign.db").write_bytes(b"this is not sqlite" * 20)
    result = runner.invoke(app, ["sweep", "run", str(sweep), "--storage", f"sqlite:///{root / 'foreign.db'}"])
    assert result.exit_code == 1 and "--storage" in result.output and "not a SQLite database" in result.output
    assert (root / "foreign.db").read_bytes() == b"this is not sqlite" * 20
    assert not (root / "sweeps" / "sweep" / "trials").exists()


def test_plan_prints_valid_invalid_and_the_total(root):
    sweep = _sweep(root, "config: cfg.yaml\nmethod: grid\nparameters:\n"
                         "  model.architecture.num_attention_heads: {values: [3, 4, 8]}\n")
    result = runner.invoke(app, ["sweep", "plan", str(sweep), "--json"])
    doc = json.loads(result.output)
    assert result.exit_code == 0 and (doc["valid"], doc["invalid"]) == (2, 1)
    assert doc["trials"][[t["valid"] for t in doc["trials"]].index(False)]["errors"][0]["code"] == "C-ARCH-001"
    text = runner.invoke(app, ["sweep", "plan", str(sweep)]).output
    assert "2 valid, 1 invalid" in text and "tokens 384" in text  # 2 x 3 steps x 4 rows x 16 tokens


def test_plan_prints_each_trials_tokens_with_thousands_separators_and_json_keeps_numbers(root):
    sweep = _sweep(root, "config: cfg.yaml\nmethod: grid\nparameters:\n  training.max_steps: {values: [20, 40]}\n")
    doc = json.loads(runner.invoke(app, ["sweep", "plan", str(sweep), "--json"]).output)
    tokens = {t["settings"]["training.max_steps"]: t["tokens"] for t in doc["trials"]}
    assert tokens == {20: 20 * 4 * 16, 40: 40 * 4 * 16}  # steps x rows x tokens, as numbers
    text = runner.invoke(app, ["sweep", "plan", str(sweep)]).output
    rows = [line.split() for line in text.splitlines() if line.split()[1:2] == ["valid"]]
    assert sorted((int(row[2]), row[3]) for row in rows) == [(20, "1,280"), (40, "2,560")], text
    assert "tokens 3,840" in text


TWELVE = """
config: cfg.yaml
method: grid
parameters:
  model.architecture.num_attention_heads: {min: 3, max: 14}
"""


def test_two_workers_on_one_storage_finish_twelve_trials_none_twice_none_lost(root):
    # 12 grid points: heads 4 and 8 divide hidden_size 32 and train (3 steps each); the other 10 are
    # refused by their plans. What is tested is the storage's bookkeeping under two processes.
    proc = apr("sweep", "run", "sweep.yaml", "--workers", "2", cwd=_sweep(root, TWELVE).parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = [line for line in proc.stdout.splitlines() if ": invalid, not trained" in line or ": finished" in line]
    numbers = [int(line.split("trial ")[1].split(":")[0]) for line in done]
    assert sorted(numbers) == list(range(12))  # each trial reported once, by one worker
    assert {line[:4] for line in done} == {"[w0]", "[w1]"}  # both workers took trials
    status = _json("status", "sweep.yaml")
    heads = sorted(t["params"]["model.architecture.num_attention_heads"] for t in status["trials"])
    assert heads == list(range(3, 15)) and status["counts"] == {"finished": 2, "invalid": 10}
    assert all(t["resumes"] == 0 for t in status["trials"])
    finished = [t for t in status["trials"] if t["state"] == "finished"]
    assert sorted(t["params"]["model.architecture.num_attention_heads"] for t in finished) == [4, 8]
    assert len({t["run_id"] for t in finished}) == 2


def test_a_killed_sweep_resumes_its_trial_and_the_best_config_reproduces_it_bitwise(root):
    write_config(root, training={"max_steps": 8, "warmup_steps": 2, "eval_interval": 4, "save_interval": 4})
    _sweep(root, """
name: resume-test
config: cfg.yaml
method: random
run_cap: 1
parameters:
  optimizer.lr: {distribution: log_uniform_values, min: 0.001, max: 0.01}
""")
    first = subprocess.Popen([sys.executable, "-m", "apr", "sweep", "run", "sweep.yaml"], cwd=root, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = root / "sweeps" / "resume-test" / "trials" / "0000"
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint-step-4.json").exists():
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    status = _json("status", "sweep.yaml")
    assert [t["state"] for t in status["trials"]] == ["interrupted"]

    again = runner.invoke(app, ["sweep", "run", "sweep.yaml"])
    assert again.exit_code == 0, again.output[-2000:]
    assert "trial 0: resuming" in again.stdout and "1 finished of 1" in again.stdout
    assert "resumed from" in (run_dir.with_suffix(".log")).read_text()
    best = _json("best", "sweep.yaml")
    assert best["number"] == 0 and best["resumes"] == 1
    assert (root / "sweeps" / "resume-test" / "metric_vs_params.svg").is_file()

    # an uninterrupted run of the best config ends at the interrupted trial's metric, bitwise
    repro = apr("train", "apply", best["best_config"], cwd=root)
    assert repro.returncode == 0, repro.stderr[-2000:]
    state = json.loads((root / "sweeps" / "resume-test" / "best-run" / "training_state.json").read_text())
    assert state["val_loss"] == best["value"] and state["experiment"] == "resume-test"


def test_status_and_best_of_a_sweep_that_never_ran(root):
    sweep = _sweep(root, "config: cfg.yaml\nmethod: grid\nparameters:\n  optimizer.lr: {values: [0.01]}\n")
    for command in ("status", "best"):
        result = runner.invoke(app, ["sweep", command, str(sweep)])
        assert result.exit_code == 1 and "no sweep has run here yet" in result.output
    assert not (root / "sweeps" / "sweep" / "study.db").exists()


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_storage(request, root):
    """The storage two machines' workers share: a SQLite file, and a PostgreSQL server (issue 54
    item 11: the multi-machine storage users run; tests/sweep/postgres.py starts a private one)."""
    if request.param == "sqlite":
        yield f"sqlite:///{root / 'shared.db'}"
        return
    from tests.sweep.postgres import start_server

    url, stop = start_server()
    try:
        yield url
    finally:
        stop()


def test_a_worker_killed_on_another_machine_is_retried_and_hyperband_prunes_from_the_retry(root, shared_storage):
    # One story, two behaviours, sharing their trainings (each apply start costs seconds of CPU):
    # 1. Two workers on one storage, each with its own sweep folder (as two machines: neither sees
    #    the other's lock). Worker A takes trial 0 (seed 1 orders the grid lr 0.01 first) and is
    #    killed -9 after its first checkpoint; worker B (this process, one start of apr and Optuna
    #    less), started after the grace period, fails it by Optuna's heartbeat (1 s, grace 3 s) and
    #    resumes it from A's checkpoint as trial 1: none lost, none run twice. (B waiting for a
    #    trial that is still alive is tested in tests/sweep/test_runner.py.)
    # 2. B then trains the grid's other point, lr 1e-6, which has barely trained by the second
    #    evaluation (step 4): Optuna's HyperbandPruner (one bracket: min_iter 2, max_iter 4, eta 3)
    #    compares it there with the retry's val loss, prunes it, and the sweep stops its run.
    # 60 steps: room for the sweep's poll (every 0.25 s) to stop the pruned run well before its end on a
    # loaded machine (at 24, load 8 let it finish first)
    write_config(root, training={"max_steps": 60, "epochs": 10, "warmup_steps": 2, "eval_interval": 2,
                                 "save_interval": 2})
    _sweep(root, """
name: beat
config: cfg.yaml
method: grid
seed: 1
early_terminate: {type: hyperband, min_iter: 2, max_iter: 4, eta: 3}
parameters:
  optimizer.lr: {values: [0.01, 1.0e-6]}
  optimizer.min_lr: {value: 1.0e-8}
""")
    url = shared_storage
    beat = ["--storage", url, "--heartbeat", "1", "--grace", "3"]
    a = subprocess.Popen([sys.executable, "-m", "apr", "sweep", "run", "sweep.yaml", "--dir", "machine-a", *beat],
                         cwd=root, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = root / "machine-a" / "trials" / "0000"
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint-step-2.json").exists():
        assert a.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    a.kill()
    a.wait()
    # B starts once the grace period is over (SQLite's clock counts whole seconds): within it, trial 0
    # is alive for B, which would take the grid's other point first and leave Hyperband no reference
    time.sleep(5.5)
    b = runner.invoke(app, ["sweep", "run", "sweep.yaml", "--dir", "machine-b", *beat])
    assert b.exit_code == 0, b.output[-3000:]
    assert f"trial 1: retry of trial 0, resuming from {run_dir}" in b.stdout and "trial 1: finished" in b.stdout
    status = _json("status", "sweep.yaml", "--storage", url, "--dir", "machine-b")
    assert status["counts"] == {"finished": 1, "retried": 1, "pruned": 1}  # none lost, none run twice
    lost, retry, bad = status["trials"]
    assert "retried as trial 1" in lost["reason"] and lost["run_id"] is None
    assert (retry["retry_of"], retry["resumes"], retry["run_dir"]) == (0, 1, str(run_dir))
    assert (retry["params"]["optimizer.lr"], bad["params"]["optimizer.lr"]) == (0.01, 1e-6)
    state = json.loads((run_dir / "training_state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 60 and retry["value"] == state["val_loss"]
    log = run_dir.with_suffix(".log").read_text()
    assert log.count("resumed from") == 1 and log.count(": finished") == 1
    # Hyperband's verdict at its rung (evaluation 2, step 4), from what the pruner compared: the two
    # trials' reported values there (the retry's inherited from trial 0 when A reported it before dying)
    import optuna

    study = optuna.load_study(study_name="beat", storage=url)
    reported = {t.number: t.intermediate_values for t in study.get_trials(deepcopy=False)}
    at_rung = reported[1][2], reported[2][2]
    pruned = json.loads((root / "machine-b" / "trials" / "0002" / "training_state.json").read_text())
    assert dict(pruned["val_loss_history"])[4] == at_rung[1]  # the pruned run's own val loss at step 4
    # the retry's state file carries A's evaluations (A's apply stops once, however often Linux repeats
    # its parent-death SIGTERM, and records them), so its history has the rung's value too
    assert dict(state["val_loss_history"])[4] == at_rung[0], (state["val_loss_history"], log[:3000])
    assert at_rung[1] > at_rung[0]
    assert bad["state"] == "pruned" and bad["last_evaluation"] == 2
    assert bad["reason"] == f"pruned at evaluation 2 (step 4): val_loss {at_rung[1]:.4f}"
    assert pruned["step"] < 60 and pruned["status"] != "finished"  # stopped by the sweep, not run to its end


def test_a_trial_runs_as_a_two_process_torchrun_job(root, monkeypatch):
    # --nproc-per-trial 2: the trial is `torchrun --nproc_per_node=2 -m apr train apply` on the CPU
    # (gloo); the worker plans it at 2 ranks and reads rank 0's state file for the metric.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    write_config(root, training={"max_steps": 4, "warmup_steps": 1, "eval_interval": 2, "save_interval": 4})
    _sweep(root, "name: ddp\nconfig: cfg.yaml\nmethod: grid\nparameters:\n  optimizer.lr: {values: [0.01]}\n")
    result = runner.invoke(app, ["sweep", "run", "sweep.yaml", "--nproc-per-trial", "2"])
    assert result.exit_code == 0, result.output[-3000:]
    run_dir = root / "sweeps" / "ddp" / "trials" / "0000"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["training"]["world_size"] == 2
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 2
    state = json.loads((run_dir / "training_state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 4
    assert state["tokens_seen"] == 4 * 4 * 16 * 2  # steps x batch x seq_len x 2 ranks
    trial = _json("status", "sweep.yaml")["trials"][0]
    assert trial["state"] == "finished" and trial["value"] == state["val_loss"]
    assert trial["plan"]["tokens"] == state["tokens_seen"]  # planned at the world size it ran at
