"""Workers (apr/sweep/runner.py) without training: the trial budget, claims, and interrupted
trials. Every trial here is invalid by its plan, so the worker loop runs end to end in milliseconds
per trial; the CLI tests train real trials (tests/cli/test_cmd_sweep.py)."""

from __future__ import annotations

import fcntl
import os
import time

import optuna
import pytest

from apr.sweep.planning import sweep_dir, trial_dir
from apr.sweep.results import trial_rows
from apr.sweep.runner import Worker, prepare, trial_budget
from apr.sweep.spec import SweepError, load_sweep
from apr.sweep.storage import default_url
from tests.sweep.sweep_helpers import tiny_root, write_sweep

INVALID_GRID = """
config: cfg.yaml
method: grid
parameters:
  model.architecture.num_attention_heads: {values: [3, 5, 6, 7, 9]}
"""


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    return load_sweep(write_sweep(tmp_path, INVALID_GRID))


def _worker(spec, count=None, folder=None, storage=None, **beat):
    folder = folder or sweep_dir(spec)
    base, study, _url, budget = prepare(spec, folder, storage, count, **beat)
    lines: list[str] = []
    return Worker(spec, study, base, folder, budget, echo=lines.append), lines


def test_invalid_trials_are_recorded_with_their_findings_and_never_trained(sweep):
    worker, lines = _worker(sweep)
    report = worker.run()
    assert sorted(report.ran) == [0, 1, 2, 3, 4] and report.exit_code == 0
    trials = worker.study.trials
    assert {t.state for t in trials} == {optuna.trial.TrialState.FAIL}
    assert sorted(t.params["model.architecture.num_attention_heads"] for t in trials) == [3, 5, 6, 7, 9]
    assert all(t.user_attrs["findings"][0]["code"] == "C-ARCH-001" for t in trials)
    folder = sweep_dir(sweep)
    assert not any(trial_dir(folder, n).exists() for n in range(5))  # no run folder: nothing ran
    assert all("invalid, not trained" in line for line in lines)


def test_the_budget_is_shared_by_every_worker_of_the_sweep(sweep):
    first, _ = _worker(sweep, count=3)
    assert first.run().ran == [0, 1, 2]
    second, _ = _worker(sweep, count=3)  # the same command again: the sweep is done
    assert second.run().ran == []
    third, _ = _worker(sweep, count=5)  # a larger budget continues it
    assert third.run().ran == [3, 4] and len(third.study.trials) == 5


def test_an_interrupted_trial_is_claimed_once_and_a_held_one_never(sweep):
    worker, _ = _worker(sweep)
    job = worker.next_job()
    assert job is not None and not job.resumed
    other, _ = _worker(sweep)
    held = other.next_job()  # trial 0's lock is held: the other worker takes a new trial
    assert held.trial.number == 1
    os.close(job.lock_fd)  # the first worker dies: the OS drops its lock
    claimed = other.next_job()
    assert claimed.trial.number == 0 and claimed.resumed and claimed.settings == job.settings
    assert worker.study.trials[0].user_attrs["resumes"] == 1
    lock = trial_dir(sweep_dir(sweep), 0).with_suffix(".lock")
    fd = os.open(lock, os.O_RDONLY)
    with pytest.raises(OSError):  # the claim holds the lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_random_and_bayes_need_a_trial_count(tmp_path):
    path = write_sweep(tmp_path, "method: bayes\nparameters:\n  optimizer.lr: {min: 0.001, max: 0.01}\n")
    with pytest.raises(SweepError, match="needs a number of trials") as info:
        trial_budget(load_sweep(path), None)
    assert "run_cap" in info.value.findings[0].message and info.value.findings[0].line == 1
    assert trial_budget(load_sweep(path), 7) == 7


def test_a_trial_whose_machine_stops_beating_is_failed_and_retried_from_its_checkpoint(sweep, tmp_path):
    # Machine A takes trial 0 and dies; machine B (another sweep folder: it cannot see A's lock)
    # shares the storage. Optuna's heartbeat (1 s, grace 2 s) lets B fail and retry it.
    a, _ = _worker(sweep, count=1, heartbeat=1, grace=2)
    job = a.next_job()
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "checkpoint-step-4.json").write_text("{}")  # as apply leaves it (a shared folder)
    b, lines = _worker(sweep, count=1, folder=tmp_path / "machine-b", storage=default_url(sweep_dir(sweep)),
                       heartbeat=1, grace=2)
    assert b.next_job() is None and b._wait_for_others()  # A's trial is alive: B waits, takes nothing
    job.beat.stop()  # A dies (its lock stays held: B never sees it)
    deadline = time.monotonic() + 15
    while (retry := b.next_job()) is None:
        assert time.monotonic() < deadline, lines
        time.sleep(0.3)
    job.beat = None
    assert retry.trial.number == 1 and retry.resumed and retry.run_dir == job.run_dir
    assert retry.settings == job.settings  # the same trial, resumed from A's last checkpoint
    rows = {r["number"]: r for r in trial_rows(b.study, sweep, b.folder)}
    assert rows[0]["state"] == "retried" and "retried as trial 1" in rows[0]["reason"]
    assert rows[1]["retry_of"] == 0 and rows[1]["resumes"] == 1
    assert any("no heartbeat" in line for line in lines) and any("retry of trial 0" in line for line in lines)
    # the retry takes trial 0's place in the budget of 1: once told, nothing is left and nobody waits
    retry.beat.stop()
    b.study.tell(retry.trial, 3.0)
    assert b.next_job() is None and not b._wait_for_others()
    assert len(b.study.trials) == 2
    os.close(job.lock_fd)
    os.close(retry.lock_fd)


def test_a_retry_without_the_checkpoint_folder_starts_afresh_in_its_own_folder(sweep, tmp_path):
    a, _ = _worker(sweep, count=1, heartbeat=1, grace=2)
    job = a.next_job()  # no checkpoint written: the machine died before its first one
    job.beat.stop()
    b, _ = _worker(sweep, count=1, folder=tmp_path / "machine-b", storage=default_url(sweep_dir(sweep)),
                   heartbeat=1, grace=2)
    deadline = time.monotonic() + 15
    while (retry := b.next_job()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    retry.beat.stop()
    assert not retry.resumed and retry.run_dir == trial_dir(tmp_path / "machine-b", 1)
    assert retry.settings == {**job.settings, "training.output_dir": str(retry.run_dir)}
    os.close(job.lock_fd)
    os.close(retry.lock_fd)


def test_the_grace_period_must_outlast_the_heartbeat(sweep):
    with pytest.raises(SweepError, match="--grace 5 must be longer than --heartbeat 5") as info:
        _worker(sweep, heartbeat=5, grace=5)
    assert info.value.findings[0].path == "--grace"
    assert not sweep_dir(sweep).exists()  # refused before anything is written


def test_a_trial_of_a_base_with_auto_keys_runs_the_values_its_plan_fitted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path, data={"batch_size": "auto", "global_batch_size": 8},
              training={"gradient_accumulation": "auto"})
    spec = load_sweep(write_sweep(tmp_path, "config: cfg.yaml\nmethod: grid\nparameters:\n"
                                            "  optimizer.lr: {values: [0.01]}\n"))
    commands = []

    class Started(Exception):
        pass

    def apply_command(base, settings, **kwargs):
        commands.append(settings)
        raise Started  # the command apply would run is all this test needs

    monkeypatch.setattr("apr.sweep.runner.apply_command", apply_command)
    worker, lines = _worker(spec)
    with pytest.raises(Started):
        worker.run()
    (settings,) = commands
    assert settings["optimizer.lr"] == 0.01
    assert settings["data.batch_size"] * settings["training.gradient_accumulation"] == 8  # fitted, not auto
    fitted = worker.study.trials[0].user_attrs["fitted"]
    assert {k: settings[k] for k in fitted} == fitted
    assert "fitted: data.batch_size=" in lines[-1]
