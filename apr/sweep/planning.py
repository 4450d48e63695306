"""Planned before spent: every trial is an apr plan (``apr.plan.build.build_plan``, the one
`apr train plan` and `apr train apply` run) of the base config with the trial's settings. A trial
whose plan has errors is never trained; its findings are its result. ``plan_sweep`` is
`apr sweep plan`: the grid (or a sample of the sampler) planned, counted and priced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.config import load_config
from apr.errors import AprError, ConfigError, Finding
from apr.plan.build import build_plan
from apr.sweep.folder import check_folder
from apr.sweep.space import grid_size, make_sampler, suggest
from apr.sweep.spec import Param, SweepError, SweepSpec, check_count, quantize


def sweep_dir(spec: SweepSpec, given: str | Path | None = None) -> Path:
    """--dir, else the file's output_dir, else sweeps/<name> (relative to the current folder, as a
    config's output_dir is)."""
    folder = given or spec.output_dir or Path("sweeps") / spec.name
    return Path(os.path.abspath(os.path.expanduser(str(folder))))


def trial_dir(folder: Path, number: int) -> Path:
    return folder / "trials" / f"{number:04d}"


def trial_settings(spec: SweepSpec, params: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The config settings a trial runs: its parameters, its own output folder, the sweep's name as
    its experiment (so `apr experiment view` and `apr runs ls` group the trials)."""
    return {**params, "training.output_dir": str(run_dir), "monitoring.tracking.experiment": spec.name}


@dataclass
class TrialPlan:
    settings: dict
    errors: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    tokens: int | None = None
    steps: int | None = None
    seconds: float | None = None
    calibrated: bool = False
    cost: float | None = None
    eval_interval: int | None = None  # the pruner counts evaluations (apr.sweep.trial)
    log_interval: int | None = None
    fitted: dict = field(default_factory=dict)  # the base's auto keys as this trial's plan fitted them

    @property
    def valid(self) -> bool:
        return not self.errors

    def reason(self) -> str:
        """The trial's failure in one line: its first error finding, and how many more."""
        if not self.errors:
            return ""
        first = self.errors[0]
        more = f" (+{len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        return f"plan: [{first.code}] {first.path + ': ' if first.path else ''}{first.message}{more}"

    def to_dict(self) -> dict:
        return {"valid": self.valid, "settings": self.settings, "tokens": self.tokens, "steps": self.steps,
                "seconds": self.seconds, "calibrated": self.calibrated, "cost": self.cost, "fitted": self.fitted,
                "errors": [f.to_dict() for f in self.errors], "reason": self.reason() or None}


def plan_trial(base: Path, settings: dict, *, gpu: str | None = None, vram: str | None = None,
               world_size: int | None = None) -> TrialPlan:
    """The trial's plan; a config the schema refuses is a plan with errors, never an exception. Auto
    keys (apr/config/auto.py) are fitted at the trial's own shape, as `apr train plan` fits them
    (``fitted``; a layout that does not fit is a plan error), and the trial runs those values."""
    try:
        plan = build_plan(base, gpu=gpu, vram=vram, world_size=world_size, overrides=settings)
    except ConfigError as err:
        return TrialPlan(settings, errors=err.findings or [Finding("error", "config", err.message)])
    except AprError as err:  # data paths and the like: the same for every trial, but a trial's verdict still
        return TrialPlan(settings, errors=err.findings or [Finding("error", "plan", err.message)])
    steps = plan.facts.get("steps") or {}
    estimate = plan.time_estimate or {}
    cost = plan.facts.get("cost") or {}
    return TrialPlan(settings, errors=plan.errors, warnings=plan.warnings, tokens=steps.get("total_tokens"),
                     steps=steps.get("total_steps"), seconds=estimate.get("estimated_seconds"),
                     calibrated=bool(estimate.get("calibrated")), cost=cost.get("total") if cost else None,
                     eval_interval=plan.config.training.eval_interval, log_interval=plan.config.training.log_interval,
                     fitted=dict((plan.facts.get("fitted") or {}).get("keys") or {}))


def check_base(spec: SweepSpec) -> Path:
    """The base config exists and loads; every listed value and range bound is one the schema takes
    for its key (a value the schema refuses alone is a mistake in the sweep file, not a trial)."""
    if spec.config is None:
        raise SweepError(f"{spec.path}: no base config", [Finding(
            "error", "sweep.missing", "the sweep needs a base config: `config: base.yaml` in the file or --config",
            path="config", file=str(spec.path), line=1, expected="a config path", got="nothing")])
    load_config(spec.config)  # a ConfigError names the base file
    problems = []
    for p in spec.params:
        for i, value in enumerate(_listed(p)):
            finding = _schema_problem(spec.config, p, value)
            if finding is not None:
                tail = (("values", i) if p.kind == "categorical" else ("value",) if p.kind == "constant"
                        else ("min",) if i == 0 else ("max",))
                loc = ("parameters", p.name, *tail)
                file, line, column = spec.where(*loc)
                problems.append(Finding("error", "sweep.bad_value", f"{p.key}: {finding.message}",
                                        path=".".join(map(str, loc)), file=file, line=line, column=column,
                                        expected=finding.expected, got=finding.got))
    if problems:
        raise SweepError(f"{spec.path}: {len(problems)} value(s) the config schema refuses", problems)
    return spec.config


def _listed(p: Param) -> list:
    if p.kind in ("constant", "categorical"):
        return list(p.values)
    if p.is_int:
        return [int(p.low), int(p.high)]
    return [quantize(p, p.low), quantize(p, p.high)]  # the values a q_ draw can take: whole for a whole q


def _schema_problem(base: Path, p: Param, value: Any) -> Finding | None:
    try:
        load_config(base, {p.key: value})
    except ConfigError as err:
        mine = [f for f in err.findings if f.path == p.key]  # an error of the key alone, not of a combination
        return mine[0] if mine else None
    return None


@dataclass
class SweepPlan:
    spec: SweepSpec
    trials: list[TrialPlan]
    planned_count: int  # the trials the sweep will run (grid size, or the run cap)
    sampled: bool  # a sample of the sampler (random, bayes), not every trial

    def to_dict(self) -> dict:
        valid = [t for t in self.trials if t.valid]
        return {"format": "apr-sweep-plan", "format_version": "1", "sweep": self.spec.name,
                "method": self.spec.method, "metric": self.spec.metric, "goal": self.spec.goal,
                "planned": len(self.trials), "sampled": self.sampled, "trial_count": self.planned_count,
                "valid": len(valid), "invalid": len(self.trials) - len(valid),
                "trials": [t.to_dict() for t in self.trials], "total": self.total()}

    def total(self) -> dict:
        """The sweep's tokens, time and cost: summed over the plans (grid), or the sample's mean per
        valid trial times the valid share of the trials the sweep will run."""
        valid = [t for t in self.trials if t.valid]
        share = len(valid) / len(self.trials) if self.trials else 0.0
        expected_valid = self.planned_count * share if self.sampled else len(valid)

        def summed(attr: str):
            values = [getattr(t, attr) for t in valid]
            if not values or any(v is None for v in values):
                return None
            return sum(values) * (expected_valid / len(values) if self.sampled else 1)

        return {"trials": self.planned_count, "valid_trials": expected_valid, "tokens": summed("tokens"),
                "seconds": summed("seconds"), "cost": summed("cost"),
                "timed": sum(t.seconds is not None for t in valid),
                "calibrated": bool(valid) and all(t.calibrated for t in valid),
                "invalid_trials_cost": 0}


def plan_sweep(spec: SweepSpec, *, sample: int | None = None, count: int | None = None, gpu: str | None = None,
               vram: str | None = None, world_size: int | None = None, settings: dict | None = None) -> SweepPlan:
    """Plan a grid's every point, or ``sample`` trials drawn by the sweep's own sampler (in memory:
    nothing is written). ``settings``: extra config settings for every trial (--price)."""
    import optuna

    check_count(count)
    base = check_base(spec)
    check_folder(spec, sweep_dir(spec))  # the folder `apr sweep run` would write: refused now, not then
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    is_grid = spec.method == "grid"
    cap = min(x for x in (count, spec.run_cap, grid_size(spec) if is_grid else None, 10**9) if x is not None)
    n = cap if is_grid and sample is None else min(sample or 20, cap)
    study = optuna.create_study(sampler=make_sampler(spec), direction=spec.goal)
    folder = sweep_dir(spec)
    trials = []
    for _ in range(n):
        trial = study.ask()
        params = suggest(trial, spec)
        trials.append(plan_trial(base, {**trial_settings(spec, params, trial_dir(folder, trial.number)),
                                        **(settings or {})}, gpu=gpu, vram=vram, world_size=world_size))
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # planned, never run: keeps the sampler moving
    return SweepPlan(spec, trials, cap, sampled=n < cap)
