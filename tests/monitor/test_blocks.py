"""The per-block norms panel (monitoring.block_norms): bars, peaks, and only where recorded."""

from __future__ import annotations

import json

from apr.monitor.app import MonitorApp
from apr.monitor.charts import level_bars
from apr.monitor.jsonmon import monitor_record
from apr.monitor.settings import MonitorSettings
from apr.monitor.state import read_once
from apr.monitor.view import BlockView, block_view

from .conftest import copy_fixture, fixed_clock
from .test_app import drive, text

NORMS = {"step": 12840, "block_grad_norm": [0.1, 0.2, 0.8, 0.4], "block_update_norm": [0.01, 0.03, 0.02, 0.005],
         "embed_grad_norm": 0.05, "embed_update_norm": 0.001, "head_grad_norm": 0.3, "head_update_norm": 0.002,
         "max_block_grad_norm": 0.8, "max_block_update_norm": 0.03}


def test_level_bars_scale_from_zero_to_the_largest_and_mark_non_finite():
    assert level_bars([0.0, 0.5, 1.0], 10) == "▁▅█"
    assert level_bars([1.0, None, 2.0], 10) == "▅!█"
    # more blocks than columns: each column is its bucket's largest, so one spike survives
    assert level_bars([0.1] * 7 + [5.0], 4) == "▁▁▁█"
    assert level_bars([], 5) == "" and level_bars([1.0], 0) == ""


def test_block_view_and_its_peaks():
    state = {"block_norms": {"step": 7, "block_grad_norm": (0.1, 0.9, 0.2), "block_update_norm": (0.1, None, 0.2)}}
    view = block_view(state)
    assert view == BlockView(7, (0.1, 0.9, 0.2), (0.1, None, 0.2))
    assert BlockView.peak(view.grads) == "0.900 #1" and BlockView.peak(view.updates) == "! #1"
    assert block_view({"block_norms": None}) is None and block_view(None) is None


def _runs(bars: str) -> str:
    """'▂▂▃▃' -> '▂▃'."""
    return "".join(c for i, c in enumerate(bars) if i == 0 or bars[i - 1] != c)


def test_level_bars_can_fill_the_width():
    assert level_bars([0.0, 0.5, 1.0], 9, fill=True) == "▁▁▁▅▅▅███"
    assert len(level_bars([0.1, 0.2, 0.3], 10, fill=True)) == 10
    assert level_bars([0.1] * 7 + [5.0], 4, fill=True) == "▁▁▁█"  # more values than columns: as before


def _state_with_norms(tmp_path):
    run = tmp_path / "run"
    path = copy_fixture("mid_run", run)
    doc = json.loads(path.read_text())
    doc["block_norms"] = NORMS
    path.write_text(json.dumps(doc))
    return run


def test_the_panel_shows_the_last_recorded_norms(tmp_path):
    app = MonitorApp(_state_with_norms(tmp_path), settings=MonitorSettings(), clock=fixed_clock)

    async def body(pilot):
        panel = app.query_one("#blocks")
        assert panel.display is True
        shown = text(app, "#blocks")
        g, u = shown.splitlines()
        assert g.startswith("g ▂") and g.endswith("0.800 #2")
        assert u.startswith("u ▃") and u.endswith("0.030 #1")
        # four blocks, each an equal share of the panel's width: the bars fill it
        assert _runs(g[2:-len(" 0.800 #2")]) == "▂▃█▅" and _runs(u[2:-len(" 0.030 #1")]) == "▃█▆▂"
        assert len(g) == len(u) == panel.content_size.width
        assert panel.border_title == "Blocks @ step 12840"
        region = panel.region
        assert region.right <= 80 and region.bottom <= 24

    drive(app, body)


def test_no_panel_for_a_run_without_them(tmp_path):
    run = tmp_path / "run"
    copy_fixture("mid_run", run)
    app = MonitorApp(run, settings=MonitorSettings(), clock=fixed_clock)

    async def body(pilot):
        assert app.query_one("#blocks").display is False

    drive(app, body)


def test_json_output_carries_them(tmp_path):
    record = monitor_record(read_once(_state_with_norms(tmp_path)), "run", fixed_clock())
    assert record["state"]["block_norms"] == NORMS
    assert "block_norms" not in record["missing_fields"]
