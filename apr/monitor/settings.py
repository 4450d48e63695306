"""The dashboard's settings: `monitoring.terminal` of the run's `config.yaml`, else defaults.

Only the keys the monitor uses are read, with plain YAML (no schema validation): a run directory
written by another apr version, or a config that no longer validates, must still be watchable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from apr.config.numbers import parse_count
from apr.config.yamlfile import read_yaml
from apr.errors import AprError

DEFAULT_REFRESH_MS = 1000
MAX_AUTO_EMA_WINDOW = 100
MIN_REFRESH_MS = 50  # faster than this only burns CPU


@dataclass(frozen=True)
class MonitorSettings:
    refresh_ms: int = DEFAULT_REFRESH_MS
    ema_window: int | None = None  # EMA span in steps for the loss chart; None: from the run's length
    show_eta: bool = True
    source: str = "default"  # where refresh_ms came from: "option", "config.yaml" or "default"
    note: str | None = None  # why config.yaml was not used, when it exists but could not be read

    @property
    def refresh_s(self) -> float:
        return self.refresh_ms / 1000.0

    def window_for(self, total_steps, last_step=None) -> int:
        """The EMA span: the configured one, else total_steps / 50 within 1..100 (a 200-step run
        smooths over 4 steps, not 100: its curve would lag the loss by most of the run)."""
        if self.ema_window:
            return self.ema_window
        steps = total_steps if isinstance(total_steps, int) and total_steps > 0 else last_step
        if not isinstance(steps, int) or steps <= 0:
            return MAX_AUTO_EMA_WINDOW
        return max(1, min(MAX_AUTO_EMA_WINDOW, round(steps / 50)))


def _positive(value, default: int | None) -> int | None:
    try:
        n = parse_count(value)
    except ValueError:
        return default
    return n if n > 0 else default


def load_settings(run_dir: str | os.PathLike | None, refresh_ms: int | None = None) -> MonitorSettings:
    """Settings for watching ``run_dir``. An explicit ``refresh_ms`` (the --refresh option) wins
    over `monitoring.terminal.refresh_rate` in ``run_dir/config.yaml``, which wins over 1000 ms."""
    refresh, window, show_eta, source, note = DEFAULT_REFRESH_MS, None, True, "default", None
    path = Path(run_dir) / "config.yaml" if run_dir is not None else None
    if path is not None and path.is_file():

        try:
            doc, _, _ = read_yaml(path, kind="settings")  # bounded: size, aliases, nesting, FIFOs
        except AprError as e:  # any YAML or I/O error: defaults, and say why
            f = e.findings[0] if e.findings else None
            doc, note = None, f"config.yaml not used: {f.message if f else e.message}"
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
                        and c.get("metric", "loss") == "loss"
                    ),
                    None,
                )
                if isinstance(charts, list)
                else None
            )
            if loss_chart is not None:
                window = _positive(loss_chart["window"], None) if loss_chart.get("window") is not None else None
                show_eta = loss_chart.get("show_eta", True) is not False
    if refresh_ms is not None:
        refresh, source = refresh_ms, "option"
    return MonitorSettings(max(MIN_REFRESH_MS, int(refresh)), window, show_eta, source, note)
