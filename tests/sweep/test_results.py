"""What a sweep leaves (apr/sweep/results.py): states, the best trial, a config that trains it
again, the plot and the importances."""

from __future__ import annotations

import re

import optuna

from apr.config import load_config
from apr.sweep.results import importances, metric_svg, status_doc, trial_rows, write_best_config
from apr.sweep.spec import load_sweep
from tests.sweep.sweep_helpers import tiny_root, write_sweep

SWEEP = """
config: cfg.yaml
method: random
run_cap: 6
metric: {name: val_loss, goal: minimize}
parameters:
  optimizer.lr: {distribution: log_uniform_values, min: 0.001, max: 0.01}
  data.batch_size: {values: [4, 8]}
"""


def _study(spec, values):
    study = optuna.create_study(direction=spec.goal)
    for i, value in enumerate(values):
        trial = study.ask()
        params = {"optimizer.lr": trial.suggest_float("optimizer.lr", 0.001, 0.01, log=True),
                  "data.batch_size": trial.suggest_categorical("data.batch_size", [4, 8])}
        trial.set_user_attr("settings", params)
        trial.set_user_attr("run_dir", f"/runs/{i}")
        if value == "invalid":
            trial.set_user_attr("findings", [{"code": "C-ARCH-001"}])
            trial.set_user_attr("reason", "plan: [C-ARCH-001] ...")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        elif value == "pruned":
            trial.report(9.0, 1)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
    return study


def test_states_counts_and_the_best_of_a_sweep(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, SWEEP))
    study = _study(spec, [3.5, "invalid", 3.1, "pruned", 3.1])
    doc = status_doc(study, spec, tmp_path, "sqlite:///x")
    assert doc["counts"] == {"finished": 3, "invalid": 1, "pruned": 1}
    assert doc["best"]["number"] == 2 and doc["best"]["value"] == 3.1  # a tie goes to the earlier trial
    spec.goal = "maximize"
    assert status_doc(study, spec, tmp_path, "u")["best"]["number"] == 0


def test_a_running_trial_without_a_live_worker_is_interrupted(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, SWEEP))
    study = optuna.create_study()
    study.ask()
    assert trial_rows(study, spec, tmp_path)[0]["state"] == "running"  # no lock file here: another machine's
    (tmp_path / "trials").mkdir()
    (tmp_path / "trials" / "0000.lock").write_text("")
    assert trial_rows(study, spec, tmp_path)[0]["state"] == "interrupted"


def test_the_plot_has_a_point_per_finished_trial_and_parameter(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, SWEEP))
    rows = trial_rows(_study(spec, [3.5, "invalid", 3.1]), spec, tmp_path)
    svg = metric_svg(rows, spec)
    assert svg.startswith("<svg") and svg.count("<circle") == 2 * 2
    assert "optimizer.lr" in svg and "data.batch_size" in svg
    xs = [float(x) for x in re.findall(r'cx="([\d.]+)"', svg)]
    assert all(0 <= x <= 600 for x in xs)


def test_importances_need_two_finished_trials(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, SWEEP))
    assert importances(_study(spec, [3.5, "invalid"])) is None
    found = importances(_study(spec, [3.5, 3.1, 2.0, 4.0]))
    assert set(found) == {"optimizer.lr", "data.batch_size"} and abs(sum(found.values()) - 1) < 1e-6


def test_the_best_config_is_the_base_with_the_best_parameters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    spec = load_sweep(write_sweep(tmp_path, SWEEP))
    best = {"number": 4, "value": 3.1, "params": {"optimizer.lr": 0.0035384535909065513, "data.batch_size": 8}}
    (tmp_path / "s").mkdir()
    path = write_best_config(spec, spec.config, best, tmp_path / "s")
    config = load_config(path).config
    assert config.optimizer.lr == 0.0035384535909065513 and config.data.batch_size == 8
    assert config.training.output_dir.endswith("best-run") and config.monitoring.tracking.experiment == "sweep"
    assert config.model.architecture.hidden_size == 32  # the rest is the base config's
