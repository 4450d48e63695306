"""Plan against actual: a run throttled against its calibrated plan raises the drift alert; a normal
one does not; the figures are recorded; a plan without a time estimate says so."""

from __future__ import annotations

import json
import time

import pytest

from apr.apply import run_apply
from apr.monitor.state import normalize
from apr.monitor.view import messages
from apr.train.drift import compare, planned, planned_range
from apr.train.stop import StepHook
from tests.train.run_helpers import make_dataset, write_config

ALERT = {"condition": "drift_step_time > 2.0", "action": "warn", "message": "steps are slower than planned"}


class Sleep(StepHook):
    """Each step takes at least 8 x the step time of the planned range's slow end: drift_step_time
    past that edge >= 3 even if the load doubled the contention since the plan."""

    def after_step(self, run, report):
        low = planned_range(run.plan_doc, 1)["low"]
        time.sleep(8 * run.tokens_per_step / low if low else 0.8)


def _state(root):
    return json.loads((root / "run" / "training_state.json").read_text())


def _apply(root, cfg, **kw):
    return run_apply(cfg, echo=lambda line: None, **kw)  # the plan reads calibrations from $APR_HOME


def test_a_throttled_run_raises_the_drift_alert_and_a_normal_one_does_not(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    doc = {"monitoring": {"drift_after_steps": 8, "alerts": [ALERT], "tracking": {"experiment": "drift"}},
           "training": {"max_steps": 12, "eval_interval": 0}}
    cfg = write_config(tmp_path, **doc)
    assert _apply(tmp_path, cfg).status == "finished"  # the first run calibrates the plan (apr/train/calibrate.py)
    assert _state(tmp_path)["drift"]["drift_step_time"] is None  # its own plan had no estimate on the CPU
    assert "no time estimate" in _state(tmp_path)["drift"]["planned_from"]

    from apr.train import run as run_module

    real_init = run_module.Run.__init__

    def throttled_init(self, *a, **kw):
        real_init(self, *a, **kw)
        self.hooks.insert(0, Sleep())

    for name, throttle in (("normal", False), ("slow", True)):
        cfg = write_config(tmp_path, name=f"{name}.yaml", **{**doc, "training": {**doc["training"],
                                                                                "output_dir": f"{name}/"}})
        if throttle:
            monkeypatch.setattr(run_module.Run, "__init__", throttled_init)
        assert _apply(tmp_path, cfg).status == "finished"
        state = json.loads((tmp_path / name / "training_state.json").read_text())
        drift = state["drift"]
        assert drift["step"] == 8 and drift["planned_from"].startswith("calibrated from")
        assert drift["memory_unknown"] == "no allocator peak on the CPU"
        assert drift["thread_choice"]["threads"] >= 1 and drift["thread_choice"]["source"]  # what the run ran with
        fired = [a for a in state["alerts"] if a["condition"] == ALERT["condition"]]
        shown, _ = normalize(state)  # the dashboard's plan-vs-actual line
        assert any(text.startswith("plan vs actual at step 8:") and "step_time" in text
                   for text, _style in messages(None, shown, "finished", 0.0, 60.0, limit=20))
        if throttle:
            assert drift["drift_step_time"] > 2.0 and len(fired) == 1
        else:
            assert drift["drift_step_time"] < 2.0 and fired == []


def test_the_plans_tokens_per_s_come_from_calibration_else_the_estimate():
    assert planned({"facts": {"calibration": {"tokens_per_s": 500.0, "what": "2 runs"}}}, 1) == \
        (500.0, "calibrated from 2 runs")
    rate, source = planned({"facts": {"time": {"estimated_seconds": 10.0}, "steps": {"total_tokens": 8000}}}, 2)
    assert rate == 400.0 and source == "the plan's time estimate"
    assert planned(None, 1)[0] is None


PLAN = {"tokens_per_s": 1000.0, "low": 800.0, "high": 1250.0, "source": "calibrated from 1 probe",
        "assumes": {"threads": 2, "cores": 2, "load_now": 0.0}}


def test_inside_the_range_is_no_drift_and_beyond_it_counts_from_the_edge():
    assert compare(900.0, PLAN, load_now=2.0)["drift_step_time"] == 0.0  # 10% slow: inside the range
    slow = compare(400.0, PLAN, load_now=2.0)  # the load average counts our own 2 threads: nobody else
    assert slow["drift_step_time"] == pytest.approx(800 / 400 - 1) and slow["load_explains"] is None
    assert slow["drift_step_time_point"] == pytest.approx(1000 / 400 - 1)
    fast = compare(2500.0, PLAN, load_now=2.0)
    assert fast["drift_step_time"] == pytest.approx(1250 / 2500 - 1)


def test_a_machine_busier_than_at_plan_time_moves_the_slow_edge_and_says_so():
    # 2 more runnable processes on 2 cores with our 2 threads: contention 2x the plan's
    loaded = compare(400.0, PLAN, load_now=4.0)
    assert loaded["load_explains"] == pytest.approx(2.0) and loaded["drift_step_time"] == 0.0
    # a real mismatch stays one under load: 8x slower than the moved edge
    assert compare(50.0, PLAN, load_now=4.0)["drift_step_time"] == pytest.approx(400 / 50 - 1)


def test_a_plan_file_from_before_the_range_compares_with_its_point():
    rate = planned_range({"facts": {"calibration": {"tokens_per_s": 500.0, "what": "2 runs"}}}, 1)
    assert rate["low"] == rate["high"] == 500.0
    assert compare(400.0, rate, load_now=None)["drift_step_time"] == pytest.approx(0.25)
