"""Snapshot tests (pytest-textual-snapshot): the dashboard's layout pinned at 80x24 and 120x40.

Each state is a recorded fixture and the clock is fixed, so the screens are the same on every
machine and every day. After an intended layout change, review and accept the new screens with

    .venv/bin/python -m pytest tests/monitor/test_snapshots.py --snapshot-update
"""

from __future__ import annotations

import pytest

from apr.monitor.app import MonitorApp
from apr.monitor.settings import MonitorSettings

from .conftest import FIXTURE_NAMES, FIXTURES, fixed_clock

SIZES = {"80x24": (80, 24), "120x40": (120, 40)}


def _app(name: str) -> MonitorApp:
    return MonitorApp(FIXTURES / name, settings=MonitorSettings(), clock=fixed_clock)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_dashboard_layout(snap_compare, name, size):
    assert snap_compare(_app(name), terminal_size=SIZES[size])


def test_log_scale_and_pause(snap_compare):
    assert snap_compare(_app("failed"), press=["l", "p"], terminal_size=SIZES["80x24"])


def test_help_screen(snap_compare):
    assert snap_compare(_app("mid_run"), press=["question_mark"], terminal_size=SIZES["80x24"])
