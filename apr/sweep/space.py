"""The sweep's search space, sampler and pruner as Optuna objects (the samplers are Optuna's own:
GridSampler, RandomSampler, TPESampler; the pruners HyperbandPruner and MedianPruner, and apr's
forecast pruner: a trial whose forecast final loss cannot beat the best finished trial's).

Optuna is imported inside the functions: importing apr.sweep stays cheap for `--help` and for the
spec checks (tests/test_lazy_imports.py).
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from typing import Any

from apr.sweep.spec import Param, SweepSpec, grid_count, grid_values, quantize


def grid_space(spec: SweepSpec) -> dict[str, list]:
    """``{config key: [points]}`` of a grid sweep (spec.py has refused continuous ranges)."""
    return {p.key: grid_values(p) for p in spec.params}


def grid_size(spec: SweepSpec) -> int:
    """The grid's points, counted without listing them (load_sweep has bounded the count)."""
    return int(math.prod(grid_count(p) or 1 for p in spec.params)) if spec.params else 1


def make_sampler(spec: SweepSpec, stream: int = 0):
    """grid -> GridSampler, random -> RandomSampler, bayes -> TPESampler. A grid is seeded by
    ``spec.seed`` alone: every worker must agree on its order. Random and TPE draw from
    ``spec.seed`` mixed with ``stream``: a worker that joins or continues a sweep must not replay
    the draws of the one that started it (they would repeat its trials); ``stream`` 0 is a fresh
    sweep's first worker, so a one-worker sweep is reproducible from its seed."""
    import optuna

    if spec.method == "grid":
        return _quiet_grid(optuna.samplers.GridSampler)(grid_space(spec), seed=spec.seed)
    seed = spec.seed if stream == 0 else int.from_bytes(
        hashlib.sha256(f"{spec.seed}:{stream}".encode()).digest()[:4], "little")
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def worker_stream(trials_so_far: int, worker: int) -> int:
    """The sampler stream of a worker: 0 for the first worker of a fresh sweep, else distinct per
    process (host, pid) and per point of the sweep it starts at."""
    if trials_so_far == 0 and worker == 0:
        return 0
    who = f"{socket.gethostname()}:{os.getpid()}:{worker}:{trials_so_far}"
    return 1 + int.from_bytes(hashlib.sha256(who.encode()).digest()[:4], "little")


def _quiet_grid(grid_sampler: type) -> type:
    """Optuna's GridSampler, whose ``after_trial`` calls ``study.stop()`` when the grid is covered: that
    only works inside ``study.optimize``, and the sweep's workers ask and tell themselves and stop at
    the trial budget (a grid's budget is at most its size), so the stop is left out."""

    class SweepGridSampler(grid_sampler):
        def after_trial(self, study, trial, state, values) -> None:
            return None

    return SweepGridSampler


def make_pruner(spec: SweepSpec):
    """``early_terminate`` as an Optuna pruner; a pruner's step is the metric's evaluation count
    (W&B's iterations), reported by apr.sweep.watch."""
    import optuna

    early = spec.early_terminate
    if early is None:
        return optuna.pruners.NopPruner()
    if early.type == "forecast":
        return _forecast_pruner_class()(early.min_iter)
    if early.type == "median":
        # Optuna decides from step n_warmup_steps on: the first decision is at evaluation min_iter
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=early.min_iter)
    return optuna.pruners.HyperbandPruner(min_resource=early.min_iter, max_resource=early.max_iter or "auto",
                                          reduction_factor=early.eta)


FINAL_EVALUATION = "final_evaluation"  # a trial's user attr: the evaluation of its last step (apr.sweep.trial)


def forecast_prunes(values: dict[int, float], final_evaluation: int | None, best: float | None,
                    min_iter: int = 1) -> bool:
    """Whether a trial whose metric was ``values`` (evaluation -> value) so far is pruned: from its
    ``max(min_iter, 4)``-th evaluation on, when even the low end of the band of its forecast final
    value (apr/track/forecast.py: a saturating power law in the evaluation count, which is the step
    over the evaluation interval: the same law) is above ``best``, the best finished trial's value."""
    from apr.track.forecast import MIN_POINTS, forecast  # lazy: numpy

    if best is None or not final_evaluation or len(values) < max(min_iter, MIN_POINTS):
        return False
    if max(values) >= final_evaluation:
        return False  # at its last evaluation: nothing left to save
    predicted = forecast(list(values.items()), int(final_evaluation))
    return predicted is not None and predicted.low > best


def _forecast_pruner_class():
    import optuna

    class ForecastPruner(optuna.pruners.BasePruner):
        """``early_terminate: {type: forecast}``: ``forecast_prunes`` against the best finished trial."""

        def __init__(self, min_iter: int = 1):
            self.min_iter = min_iter

        def prune(self, study, trial) -> bool:
            done = [t.value for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.value is not None and math.isfinite(t.value)]
            return forecast_prunes(dict(trial.intermediate_values), trial.user_attrs.get(FINAL_EVALUATION),
                                   min(done) if done else None, self.min_iter)

    return ForecastPruner


def suggest(trial, spec: SweepSpec) -> dict[str, Any]:
    """Ask ``trial`` for every parameter; returns the config settings ``{key: value}`` the trial runs."""
    return {p.key: suggest_one(trial, p) for p in spec.params}


def suggest_one(trial, p: Param) -> Any:
    if p.kind in ("constant", "categorical"):
        return trial.suggest_categorical(p.key, list(p.values))
    if p.kind == "int_uniform":
        return trial.suggest_int(p.key, int(p.low), int(p.high))
    if p.kind == "q_uniform":
        return quantize(p, trial.suggest_float(p.key, float(p.low), float(p.high), step=float(p.q)))
    # Optuna has no stepped log scale: W&B rounds a q_log draw to q, and so does quantize
    return quantize(p, trial.suggest_float(p.key, float(p.low), float(p.high), log=p.log))
