"""docs/monitor.md stays current: JSON keys, key bindings and status labels."""

from __future__ import annotations

from pathlib import Path

from apr.monitor.app import MonitorApp
from apr.monitor.discover import ActiveRun
from apr.monitor.jsonmon import monitor_record
from apr.monitor.state import read_once
from apr.monitor.view import STATUS_LABELS

from .conftest import FIXTURES

TEXT = (Path(__file__).resolve().parents[2] / "docs" / "monitor.md").read_text()


def test_json_keys_are_documented():
    record = monitor_record(read_once(FIXTURES / "mid_run"), "x", 0.0)
    active = ActiveRun("r", "e", "/o", "running").to_dict()
    missing = [k for k in (*record, *active) if f'"{k}"' not in TEXT and f"`{k}`" not in TEXT]
    assert not missing, missing


def test_keys_and_status_labels_are_documented():
    for binding in MonitorApp.BINDINGS:
        key = {"question_mark": "?", "ctrl+c": "Ctrl+C"}.get(binding.key, binding.key)
        assert f"`{key}`" in TEXT, key
    for label, _ in STATUS_LABELS.values():
        assert f"`{label}`" in TEXT, label
