"""One trial as a process (apr/sweep/trial.py): settings survive the command line exactly, the
metric is read from the run's state file, and Optuna's pruner stops a losing run."""

from __future__ import annotations

import json
import signal
import sys

import optuna

from apr.config.layers import parse_settings
from apr.sweep.space import make_pruner
from apr.sweep.spec import load_sweep
from apr.sweep.trial import TrialProcess, apply_command, final_metric, metric_history, setting_args


def test_settings_round_trip_through_the_command_line_exactly():
    settings = {"optimizer.lr": 0.0035384535909065513, "optimizer.name": "adamw", "training.grad_clip": None,
                "data.shuffle": True, "training.output_dir": "/tmp/a b/run", "training.lr_scheduler": "1e-3"}
    assert parse_settings(setting_args(settings)) == settings


def test_apply_command_resumes_and_runs_under_torchrun():
    cmd = apply_command("cfg.yaml", {"optimizer.lr": 0.01}, resume=True, nproc=2)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc_per_node=2" in cmd
    assert cmd[-8:] == ["-m", "apr", "train", "apply", "cfg.yaml", "optimizer.lr=0.01", "--resume", "latest"]
    assert apply_command("cfg.yaml", {}, resume=False)[:3] == [sys.executable, "-m", "apr"]


def test_the_metric_history_skips_step_zero_and_non_finite_values():
    state = {"val_loss_history": [[0, 4.1], [4, 3.9], [8, None], [12, 3.5]], "loss_history": [[2, 4.0]],
             "val_loss": 3.5, "loss": None}
    assert metric_history(state, "val_loss") == [(4, 3.9), (12, 3.5)]
    assert metric_history(state, "loss") == [(2, 4.0)]
    assert final_metric(state, "val_loss") == 3.5 and final_metric(state, "loss") is None


# A stand-in trainer: writes training_state.json as a run does (atomically, a growing val history)
# and stops on SIGTERM with 143, as apply does. What is tested is the watcher, not training.
FAKE_RUN = """
import json, os, signal, sys, time
run = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
history = []
for step in range(4, 44, 4):
    history.append([step, 10.0 - step / 100])
    with open(run + "/tmp.json", "w") as f:
        json.dump({"val_loss_history": history, "val_loss": history[-1][1]}, f)
    os.replace(run + "/tmp.json", run + "/training_state.json")
    time.sleep(0.3)
"""


def test_a_run_worse_than_the_median_is_pruned_and_stopped(tmp_path):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("method: grid\nparameters:\n  optimizer.lr: {value: 0.1}\n"
                     "early_terminate: {type: median, min_iter: 2}\n")
    study = optuna.create_study(pruner=make_pruner(load_sweep(sweep)))
    good = study.ask()
    for evaluation in range(1, 11):
        good.report(1.0, evaluation)
    study.tell(good, 1.0)
    run = tmp_path / "run"
    run.mkdir()
    process = TrialProcess([sys.executable, "-c", FAKE_RUN, str(run)], run, tmp_path / "run.log", "val_loss",
                           interval=4)
    trial = study.ask()
    outcome = process.run(trial, lambda: None)
    assert outcome.pruned_at is not None and outcome.exit_code == 143
    evaluation, step, value = outcome.pruned_at
    assert evaluation == step // 4 == 2  # min_iter 2: the first decision is at the second evaluation
    assert value == 10.0 - step / 100
    assert len(json.loads((run / "training_state.json").read_text())["val_loss_history"]) < 10  # stopped early


def test_a_stop_signal_is_forwarded_once_and_reported(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    process = TrialProcess([sys.executable, "-c", FAKE_RUN, str(run)], run, tmp_path / "run.log", "val_loss",
                           interval=4)
    outcome = process.run(None, lambda: signal.SIGTERM)
    assert outcome.interrupted == signal.SIGTERM and outcome.exit_code == 143 and outcome.pruned_at is None


# A stand-in run whose validation curve heads for 2 + 6 / sqrt(40) = 2.95 at its last evaluation
POWER_RUN = """
import json, os, signal, sys, time
run = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
history = []
for step in range(4, 164, 4):
    history.append([step, 2.0 + 6.0 * (step / 4) ** -0.5])
    with open(run + "/tmp.json", "w") as f:
        json.dump({"val_loss_history": history, "val_loss": history[-1][1], "total_steps": 160}, f)
    os.replace(run + "/tmp.json", run + "/training_state.json")
    time.sleep(0.2)
"""


def test_a_run_whose_forecast_cannot_beat_the_best_is_pruned_with_its_horizon_from_the_state(tmp_path):
    from apr.sweep.space import FINAL_EVALUATION

    sweep = tmp_path / "s.yaml"
    sweep.write_text("method: grid\nparameters:\n  optimizer.lr: {value: 0.1}\nearly_terminate: {type: forecast}\n")
    study = optuna.create_study(pruner=make_pruner(load_sweep(sweep)))
    study.tell(study.ask(), 2.5)  # the best finished trial
    run = tmp_path / "run"
    run.mkdir()
    trial = study.ask()
    outcome = TrialProcess([sys.executable, "-c", POWER_RUN, str(run)], run, tmp_path / "run.log", "val_loss",
                           interval=4).run(trial, lambda: None)
    assert outcome.exit_code == 143 and outcome.pruned_at is not None
    evaluation, step, _ = outcome.pruned_at
    assert 4 <= evaluation < 40 and step == 4 * evaluation  # decided once 4 validations pin the curve
    assert study.trials[-1].user_attrs[FINAL_EVALUATION] == 40  # total_steps 160 / interval 4
