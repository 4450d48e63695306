"""Alert severities (the reference's Andon levels), one place for the config, the recorder, the
monitor and `apr runs show`: what each means and how the older ``action`` spelling maps onto them."""

from __future__ import annotations

SEVERITIES = ("critical", "error", "warning", "info")  # most severe first: the order counts are shown in
STOPPING_SEVERITIES = ("critical", "error")  # these stop the run; warning and info record and show
ACTION_SEVERITY = {"stop": "error", "warn": "warning"}  # monitoring.alerts[].action, the older spelling


def severity_of(severity: str | None, action: str | None = None) -> str:
    """An alert's severity: its own, else what its action means (a record from before severities),
    else warning."""
    if severity in SEVERITIES:
        return severity
    return ACTION_SEVERITY.get(action or "", "warning")


def action_of(severity: str) -> str:
    """``stop`` or ``warn``: what the run loop does with an alert of ``severity``."""
    return "stop" if severity in STOPPING_SEVERITIES else "warn"


def count_by_severity(alerts: list[dict]) -> dict[str, int]:
    """``{"critical": 0, "error": 1, ...}`` over alert records (dicts with severity and/or action)."""
    counts = dict.fromkeys(SEVERITIES, 0)
    for a in alerts:
        counts[severity_of(a.get("severity"), a.get("action"))] += 1
    return counts
