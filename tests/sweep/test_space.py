"""The Optuna side (apr/sweep/space.py): each W&B distribution samples inside its range with
Optuna's own samplers, a grid visits every point once, and workers do not replay each other."""

from __future__ import annotations

import math

import optuna

from apr.sweep.planning import check_base
from apr.sweep.space import grid_size, make_pruner, make_sampler, suggest, worker_stream
from apr.sweep.spec import load_sweep
from tests.sweep.sweep_helpers import tiny_root

SPACE = """
method: {method}
run_cap: 40
parameters:
  optimizer.lr: {{distribution: log_uniform_values, min: 0.0001, max: 0.01}}
  data.batch_size: {{values: [4, 8]}}
  training.warmup_steps: {{min: 1, max: 5}}
  optimizer.weight_decay: {{distribution: q_uniform, min: 0.0, max: 0.2, q: 0.05}}
  optimizer.beta2: {{distribution: q_log_uniform_values, min: 0.9, max: 0.999, q: 0.001}}
"""


def _spec(tmp_path, method="random", text=SPACE):
    path = tmp_path / "s.yaml"
    path.write_text(text.format(method=method))
    return load_sweep(path)


def _draw(spec, n, stream=0):
    study = optuna.create_study(sampler=make_sampler(spec, stream))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append(suggest(trial, spec))
        study.tell(trial, 1.0)
    return out


def test_random_and_tpe_draw_inside_every_range(tmp_path):
    for method in ("random", "bayes"):
        for s in _draw(_spec(tmp_path, method), 30):
            assert 1e-4 <= s["optimizer.lr"] <= 1e-2 and s["data.batch_size"] in (4, 8)
            assert isinstance(s["training.warmup_steps"], int) and 1 <= s["training.warmup_steps"] <= 5
            assert math.isclose(s["optimizer.weight_decay"] / 0.05, round(s["optimizer.weight_decay"] / 0.05))
            assert math.isclose(s["optimizer.beta2"] * 1000, round(s["optimizer.beta2"] * 1000))


def test_log_uniform_spreads_over_decades(tmp_path):
    lrs = [s["optimizer.lr"] for s in _draw(_spec(tmp_path), 200)]
    below = sum(lr < 1e-3 for lr in lrs)  # half the log range; a linear draw would put ~9% here
    assert 70 < below < 130


def test_a_grid_visits_each_point_once(tmp_path):
    text = ("method: grid\nparameters:\n  data.batch_size: {values: [4, 8, 16]}\n"
            "  training.warmup_steps: {min: 1, max: 2}\n")
    path = tmp_path / "g.yaml"
    path.write_text(text)
    spec = load_sweep(path)
    assert grid_size(spec) == 6
    points = {tuple(sorted(s.items())) for s in _draw(spec, 6)}
    assert len(points) == 6


def test_the_first_worker_is_reproducible_and_others_draw_other_streams(tmp_path):
    spec = _spec(tmp_path)
    assert _draw(spec, 3) == _draw(spec, 3)
    joined = worker_stream(trials_so_far=5, worker=0)
    assert worker_stream(0, 0) == 0 and joined != 0 and worker_stream(0, 1) not in (0, joined)
    assert _draw(spec, 3, joined) != _draw(spec, 3)


def test_early_terminate_becomes_optunas_pruner(tmp_path):
    text = SPACE + "early_terminate: {{type: hyperband, min_iter: 2, eta: 3}}\n"
    pruner = make_pruner(_spec(tmp_path, text=text))
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    text = SPACE + "early_terminate: {{type: median, min_iter: 2}}\n"
    assert isinstance(make_pruner(_spec(tmp_path, text=text)), optuna.pruners.MedianPruner)
    assert isinstance(make_pruner(_spec(tmp_path)), optuna.pruners.NopPruner)


def test_q_distributions_give_values_on_their_step_whole_for_a_whole_step(tmp_path):
    # an integer key with a whole q takes whole numbers, even when the log bounds are not (e^0..e^1.5)
    text = """
config: cfg.yaml
method: {method}
run_cap: 20
parameters:
  training.eval_batches: {{distribution: q_log_uniform, min: 0, max: 1.5, q: 1}}
  training.warmup_steps: {{distribution: q_uniform, min: 2, max: 8, q: 2}}
  optimizer.beta2: {{distribution: q_uniform, min: 0.9, max: 0.99, q: 0.01}}
"""
    tiny_root(tmp_path)
    spec = _spec(tmp_path, text=text)
    check_base(spec)  # the bounds as drawn (1 and 4) suit the integer key: not refused
    draws = _draw(spec, 20)
    assert {type(d["training.eval_batches"]) for d in draws} == {int}
    assert {d["training.eval_batches"] for d in draws} <= {1, 2, 3, 4}
    assert {d["training.warmup_steps"] for d in draws} <= {2, 4, 6, 8}
    assert all(isinstance(d["training.warmup_steps"], int) for d in draws)
    assert all(d["optimizer.beta2"] == round(d["optimizer.beta2"], 2) for d in draws)  # 0.95, not 0.9500000000000001


def _curve(evaluations, floor=2.0, scale=6.0, alpha=0.5):
    return {e: floor + scale * e ** -alpha for e in evaluations}


def test_the_forecast_pruner_stops_a_trial_whose_whole_band_is_above_the_best(tmp_path):
    text = SPACE + "early_terminate: {{type: forecast, min_iter: 2}}\n"
    study = optuna.create_study(pruner=make_pruner(_spec(tmp_path, text=text)))
    assert type(study.pruner).__name__ == "ForecastPruner"
    assert not _tells(study, values=_curve(range(1, 6)))  # no finished trial yet: nothing to beat
    study.tell(study.ask(), 2.5)  # a finished trial ended at 2.5
    # this curve heads for 2 + 6 / sqrt(40) = 2.95 at its last evaluation: worse than 2.5, pruned
    assert _tells(study, values=_curve(range(1, 6)))
    assert not _tells(study, values=_curve(range(1, 4)))  # 3 evaluations: too few to forecast
    study.tell(study.ask(), 1.0)
    assert _tells(study, values=_curve(range(1, 6)))


def test_the_forecast_pruner_keeps_a_trial_that_may_still_win(tmp_path):
    text = SPACE + "early_terminate: {{type: forecast}}\n"
    study = optuna.create_study(pruner=make_pruner(_spec(tmp_path, text=text)))
    study.tell(study.ask(), 3.5)
    assert not _tells(study, values=_curve(range(1, 6)))  # forecast 2.95 < 3.5: it goes on
    trial = study.ask()
    for e, v in _curve(range(1, 6)).items():
        trial.report(v, e)
    assert not trial.should_prune()  # without its final evaluation (user attr) there is no horizon


def _tells(study, values) -> bool:
    from apr.sweep.space import FINAL_EVALUATION

    trial = study.ask()
    trial.set_user_attr(FINAL_EVALUATION, 40)
    for e, v in values.items():
        trial.report(v, e)
    pruned = trial.should_prune()
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    return pruned


def test_a_forecast_pruner_needs_a_minimized_metric(tmp_path):
    import pytest

    from apr.sweep.spec import SweepError

    text = SPACE + "metric: {{name: val_loss, goal: maximize}}\nearly_terminate: {{type: forecast}}\n"
    with pytest.raises(SweepError) as e:
        _spec(tmp_path, text=text)
    assert any("metric.goal minimize" in f.message or "minimize" in str(f.expected) for f in e.value.findings)
