"""The dashboard's settings: `monitoring.terminal` of the run's `config.yaml`, else defaults.

Only the keys the monitor uses are read, with plain YAML (no schema validation): a run directory
written by another apr version, or a config that no longer validates, must still be watchable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from apr.config.numbers import parse_count

DEFAULT_REFRESH_MS = 1000
DEFAULT_EMA_WINDOW = 100
MIN_REFRESH_MS = 50  # faster than this only burns CPU


@dataclass(frozen=True)
class MonitorSettings:
    refresh_ms: int = DEFAULT_REFRESH_MS
    ema_window: int = DEFAULT_EMA_WINDOW  # EMA span in steps for the loss chart
    show_eta: bool = True
    source: str = "default"  # where refresh_ms came from: "option", "config.yaml" or "default"
    note: str | None = None  # why config.yaml was not used, when it exists but could not be read

    @property
    def refresh_s(self) -> float:
        return self.refresh_ms / 1000.0


def _positive(value, default: int) -> int:
    try:
        n = parse_count(value)
    except ValueError:
        return default
    return n if n > 0 else default


def load_settings(run_dir: str | os.PathLike | None, refresh_ms: int | None = None) -> MonitorSettings:
    """Settings for watching ``run_dir``. An explicit ``refresh_ms`` (the --refresh option) wins
    over `monitoring.terminal.refresh_rate` in ``run_dir/config.yaml``, which wins over 1000 ms."""
    refresh, window, show_eta, source, note = DEFAULT_REFRESH_MS, DEFAULT_EMA_WINDOW, True, "default", None
    path = Path(run_dir) / "config.yaml" if run_dir is not None else None
    if path is not None and path.is_file():
        try:
            import yaml

            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except Exception as e:  # any YAML or I/O error: defaults, and say why
            doc, note = None, f"config.yaml not used: {type(e).__name__}"
        terminal = ((doc or {}).get("monitoring") or {}).get("terminal") if isinstance(doc, dict) else None
        if isinstance(terminal, dict):
            if "refresh_rate" in terminal:
                refresh, source = _positive(terminal["refresh_rate"], DEFAULT_REFRESH_MS), "config.yaml"
            charts = terminal.get("charts")
            loss_chart = (
                next(
                    (
                        c
                        for c in charts
                        if isinstance(c, dict) and c.get("type", "loss_curve") == "loss_curve"
                    ),
                    None,
                )
                if isinstance(charts, list)
                else None
            )
            if loss_chart is not None:
                window = _positive(loss_chart.get("window", DEFAULT_EMA_WINDOW), DEFAULT_EMA_WINDOW)
                show_eta = loss_chart.get("show_eta", True) is not False
    if refresh_ms is not None:
        refresh, source = refresh_ms, "option"
    return MonitorSettings(max(MIN_REFRESH_MS, int(refresh)), window, show_eta, source, note)
