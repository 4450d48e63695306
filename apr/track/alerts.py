"""Alerts (the reference's Andon): `monitoring.alerts` conditions evaluated with the shared CEL engine.

A condition sees the step's metrics under these names: loss, val_loss, lr (alias learning_rate),
grad_norm (alias gradient_norm), step, epoch, tokens_per_s, and the per-block telemetry
(monitoring.block_norms): the lists block_grad_norm and block_update_norm, and embed_/head_grad_norm,
embed_/head_update_norm, max_block_grad_norm, max_block_update_norm. A condition whose variables are not
all known yet (val_loss before the first evaluation) is skipped, not fired. `warn` alerts fire once
when their condition becomes true and again only after it has been false; `stop` alerts fire on
every check while true (the trainer stops at the first). Each rule has a severity (apr/severity.py):
critical and error alerts have the action `stop`, warning and info `warn`. Non-finite loss or gradients are not an
alert: the engine raises NonFiniteError on them and the run stops (docs/training.md).
"""

from __future__ import annotations

import difflib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from apr.cel import CelError, compile_expr, evaluate, free_variables
from apr.errors import AprError, Finding
from apr.fmt import fmt_float
from apr.severity import action_of, severity_of
from apr.track.state import BLOCK_NORM_KEYS, BLOCK_NORM_LISTS, DATA_DRIFT_KEYS

# Metric names a condition may use -> the metrics key they read.
ALERT_VARIABLES: dict[str, str] = {
    "loss": "loss",
    "val_loss": "val_loss",
    "lr": "lr",
    "learning_rate": "lr",
    "grad_norm": "grad_norm",
    "gradient_norm": "grad_norm",
    "step": "step",
    "epoch": "epoch",
    "tokens_per_s": "tokens_per_s",
    **{name: name for name in BLOCK_NORM_KEYS},
    # the run against its plan, known from monitoring.drift_after_steps on (apr/train/drift.py)
    "drift_step_time": "drift_step_time",
    "drift_tokens_per_s": "drift_tokens_per_s",
    "drift_memory": "drift_memory",
    # rows read so far against rows ahead, at monitoring.data_drift.interval steps (apr/train/datadrift.py)
    **{name: name for name in DATA_DRIFT_KEYS},
}
_INT_VARIABLES = {"step"}
# Lists of floats, one per block (monitoring.block_norms): `block_grad_norm.exists(x, x > 5.0)`,
# `block_update_norm[0] > 1.0`; known from the first log step.
_LIST_VARIABLES = set(BLOCK_NORM_LISTS)
# In-training task scores (evaluation.tasks): `eval.<task>.acc` and `eval.<task>.acc_norm`, a map
# that exists once the first task evaluation has run (docs/eval.md).
EVAL_VARIABLE = "eval"
_EVAL_REF = re.compile(r"\beval\.([A-Za-z_][A-Za-z0-9_]*)\.(acc_norm|acc)\b")


@dataclass(frozen=True)
class Alert:
    """One fired alert."""

    condition: str
    action: str  # "stop" | "warn": what the run loop does (apr.severity.action_of)
    message: str  # the configured message (or "alert: <condition>") and the values that fired it
    step: int | None = None
    time: float = 0.0
    values: dict[str, Any] = field(default_factory=dict)
    severity: str = "warning"  # critical | error | warning | info

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "step": self.step,
            "condition": self.condition,
            "severity": self.severity,
            "action": self.action,
            "message": self.message,
        }


def _sample_variables(condition: str = "") -> dict[str, Any]:
    sample: dict[str, Any] = {name: (1 if name in _INT_VARIABLES else [1.0, 1.0] if name in _LIST_VARIABLES else 1.0)
                              for name in ALERT_VARIABLES}
    tasks = {task for task, _ in _EVAL_REF.findall(condition)}
    sample[EVAL_VARIABLE] = {task: {"acc": 0.5, "acc_norm": 0.5} for task in tasks}
    return sample


def metric_suggestions(unknown: list[str]) -> str:
    """``"; did you mean 'loss'?"`` for the unknown metric names close to a known one ('' if none)."""
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(ALERT_VARIABLES), n=1, cutoff=0.6)
        if close:
            hints.append(f"'{close[0]}'" if len(unknown) == 1 else f"'{close[0]}' for {name}")
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def alert_findings(alerts: list, file: str | None = None, block_norms: bool = True,
                   data_drift_off: str | None = None) -> list[Finding]:
    """Check `monitoring.alerts` entries up front: CEL syntax, known metric names, boolean result,
    no per-block norm when `monitoring.block_norms` is off and no data drift figure when
    ``data_drift_off`` says why none is recorded (the condition could never be evaluated).
    Returns findings (empty when all are usable); `apr train validate` can report them."""

    findings = []
    for i, alert in enumerate(alerts):
        path = f"monitoring.alerts[{i}].condition"
        condition = alert.condition
        try:
            compile_expr(condition)
        except CelError as e:
            findings.append(Finding("error", "alert.invalid_condition", e.message, path=path, file=file))
            continue

        unknown = sorted(set(free_variables(condition)) - set(ALERT_VARIABLES) - {EVAL_VARIABLE})
        if unknown:
            findings.append(
                Finding(
                    "error",
                    "alert.unknown_metric",
                    f"alert condition {condition!r} uses unknown metric(s) {', '.join(unknown)}"
                    + metric_suggestions(unknown),
                    path=path,
                    file=file,
                    expected="names among " + ", ".join(ALERT_VARIABLES) + ", eval.<task>.acc, eval.<task>.acc_norm",
                    got=", ".join(unknown),
                )
            )
            continue
        off = sorted(set(free_variables(condition)) & set(BLOCK_NORM_KEYS)) if not block_norms else []
        if off:
            findings.append(
                Finding(
                    "error",
                    "alert.block_norms_off",
                    f"alert condition {condition!r} uses {', '.join(off)}, which are not recorded: "
                    "monitoring.block_norms is false",
                    path=path,
                    file=file,
                    expected="monitoring.block_norms: true, or a condition without per-block norms",
                    got="monitoring.block_norms: false",
                )
            )
            continue
        never = sorted(set(free_variables(condition)) & set(DATA_DRIFT_KEYS)) if data_drift_off else []
        if never:
            findings.append(Finding(
                "error", "alert.data_drift_off", f"alert condition {condition!r} uses {', '.join(never)}, which are "
                f"not recorded: {data_drift_off}", path=path, file=file,
                expected="monitoring.data_drift.interval > 0 on one data.train folder", got=data_drift_off))
            continue
        try:
            result = evaluate(condition, _sample_variables(condition))
        except CelError as e:
            findings.append(Finding("error", "alert.invalid_condition", e.message, path=path, file=file))
            continue
        if not isinstance(result, bool):
            findings.append(
                Finding(
                    "error",
                    "alert.not_boolean",
                    f"alert condition {condition!r} does not evaluate to true/false",
                    path=path,
                    file=file,
                    expected="a boolean expression such as 'loss > 10'",
                    got=type(result).__name__,
                )
            )
    return findings


class AlertEvaluator:
    """Compiled `monitoring.alerts`; `check(values)` returns the alerts that fire now."""

    def __init__(self, alerts: list):
        findings = alert_findings(alerts)
        if findings:
            raise AprError("invalid monitoring.alerts", findings)

        self._alerts = [(a.condition, _severity(a), a.message, free_variables(a.condition)) for a in alerts]
        self._active = [False] * len(self._alerts)
        self.errors: list[str] = []  # evaluation failures at run time, one entry per condition

    def __len__(self) -> int:
        return len(self._alerts)

    def check(self, values: dict[str, Any], step: int | None = None, now: float | None = None) -> list[Alert]:

        fired = []
        for i, (condition, severity, message, names) in enumerate(self._alerts):
            action = action_of(severity)
            variables = {}
            for name in names:
                if name == EVAL_VARIABLE:  # a map of task scores, known after the first task evaluation
                    if not values.get(EVAL_VARIABLE):
                        break
                    variables[name] = values[EVAL_VARIABLE]
                    continue
                value = values.get(ALERT_VARIABLES[name])
                if value is None or isinstance(value, bool):
                    break
                if name in _LIST_VARIABLES:
                    items = _float_list(value)
                    if items is None:
                        break
                    variables[name] = items
                    continue
                try:
                    value = int(value) if name in _INT_VARIABLES else float(value)
                except (TypeError, ValueError):
                    break
                if value != value:  # NaN: the non-finite check, not the alerts, handles it
                    break
                variables[name] = value
            else:
                try:
                    result = evaluate(condition, variables) is True
                except CelError as e:
                    if not any(err.startswith(condition + ":") for err in self.errors):
                        self.errors.append(f"{condition}: {e.message}")
                    continue
                was_active = self._active[i]
                self._active[i] = result
                if result and (action == "stop" or not was_active):
                    flat = {k: v for k, v in variables.items() if k != EVAL_VARIABLE and k not in _LIST_VARIABLES}
                    flat.update({f"max({k})": max(variables[k]) for k in variables
                                 if k in _LIST_VARIABLES and variables[k]})
                    flat.update({f"eval.{t}.{m}": variables[EVAL_VARIABLE][t][m]
                                 for t, m in _EVAL_REF.findall(condition) if EVAL_VARIABLE in variables
                                 and m in variables[EVAL_VARIABLE].get(t, {})})
                    shown = ", ".join(f"{k}={fmt_float(v)}" for k, v in flat.items())
                    text = (message or f"alert: {condition}") + (f" ({shown})" if shown else "")
                    fired.append(
                        Alert(
                            condition=condition,
                            action=action,
                            message=text,
                            step=step,
                            time=time.time() if now is None else now,
                            values=flat,
                            severity=severity,
                        )
                    )
        return fired


def _severity(alert) -> str:
    """An AlertConfig's severity; an object without one (older callers) by its action."""
    effective = getattr(alert, "effective_severity", None)
    if effective is not None:
        return effective
    action = getattr(alert, "action", None)
    return severity_of(None, str(getattr(action, "value", action)) if action is not None else None)


def _float_list(value: Any) -> list[float] | None:
    """A per-block list as floats; None when it is not a list or holds a missing/non-finite value."""
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for item in value:
        if item is None or isinstance(item, bool):
            return None
        try:
            f = float(item)
        except (TypeError, ValueError):
            return None
        if f != f:
            return None
        out.append(f)
    return out
