"""What `apr monitor` does in each mode; the CLI parses, calls one of these, and renders."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from apr.errors import AprError, Finding
from apr.monitor.dashboard import load_dashboard
from apr.monitor.discover import Discovery, find_active_runs
from apr.monitor.jsonmon import FORMAT_VERSION, follow, snapshot
from apr.monitor.settings import load_settings


def active_runs_document(refresh_ms: int | None = None) -> dict:
    """`apr monitor --json` without a run: the active runs of the global registry."""
    settings = load_settings(None, refresh_ms)
    found = find_active_runs(refresh_s=settings.refresh_s)
    return {
        "format_version": FORMAT_VERSION,
        "registry": str(found.registry),
        "active_runs": [r.to_dict() for r in found.runs],
        "notes": found.notes,
    }


def print_json_once(run_dir: Path, refresh_ms: int | None, include_history: bool) -> int:
    """`apr monitor --json RUN_DIR`: one object on stdout; AprError when there is no state."""
    settings = load_settings(run_dir, refresh_ms)
    doc = snapshot(run_dir, refresh_s=settings.refresh_s, include_history=include_history)
    print(json.dumps(doc, default=str))
    return 0


def print_json_follow(
    run_dir: Path, refresh_ms: int | None, timeout_s: float | None, include_history: bool
) -> int:
    """`apr monitor --json --follow RUN_DIR`: one line per change until the run ends (exit 0),
    or AprError when ``timeout_s`` passes first."""
    settings = load_settings(run_dir, refresh_ms)

    def emit(record: dict) -> None:
        sys.stdout.write(json.dumps(record, default=str) + "\n")
        sys.stdout.flush()

    reason, last = follow(run_dir, emit, settings.refresh_s, timeout_s, include_history)
    if reason == "timeout":
        status = last.get("status") or f"without a readable state ({(last.get('problem') or {}).get('kind')})"
        raise AprError(
            f"timed out after {timeout_s:g} s; the run is still {status}",
            [
                Finding(
                    "error",
                    "monitor.timeout",
                    f"the run did not end within --timeout {timeout_s:g} s",
                    file=str(run_dir),
                    got=str(status),
                )
            ],
        )
    return 0


def _no_active_runs(found: Discovery) -> AprError:
    findings = [Finding("info", "monitor.discovery", note) for note in found.notes]
    findings.append(
        Finding(
            "error",
            "monitor.no_active_runs",
            "no active run (fresh heartbeat) in the registry; pass a run directory: apr monitor RUN_DIR",
            file=str(found.registry),
        )
    )
    return AprError("no active runs to monitor", findings)


def run_dashboard(run_dir: Path | None, refresh_ms: int | None, timeout_s: float | None,
                  dashboard: Path | None = None) -> int:
    """The Textual dashboard on this terminal (no mouse), laid out by the ``dashboard`` file (default:
    the built-in layout). Without ``run_dir``: the one active run, or a picker when there are
    several; AprError when there is none or the dashboard file is bad."""
    from apr.monitor.app import MonitorApp

    layout = load_dashboard(dashboard)  # before anything starts: a bad file is exit 1, no screen
    candidates = []
    if run_dir is None:
        found = find_active_runs(refresh_s=load_settings(None, refresh_ms).refresh_s)
        if not found.runs:
            raise _no_active_runs(found)
        candidates = found.runs
    app = MonitorApp(run_dir, candidates=candidates, quit_after_s=timeout_s, refresh_ms=refresh_ms, dashboard=layout)
    app.run(mouse=False)
    return 0
