"""Workers (apr/sweep/runner.py) without training: the trial budget, claims, and interrupted
trials. Every trial here is invalid by its plan, so the worker loop runs end to end in milliseconds
per trial; the CLI tests train real trials (tests/cli/test_cmd_sweep.py)."""

from __future__ import annotations

import fcntl
import os

import optuna
import pytest
from sweep_helpers import tiny_root, write_sweep

from apr.sweep.planning import sweep_dir, trial_dir
from apr.sweep.runner import Worker, prepare, trial_budget
from apr.sweep.spec import SweepError, load_sweep

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


def _worker(spec, count=None):
    folder = sweep_dir(spec)
    base, study, _url, budget = prepare(spec, folder, None, count)
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
