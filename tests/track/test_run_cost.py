"""Issue 16 item 5: a run with training.price_per_gpu_hour records its live cost (elapsed time x
GPUs x price) in training_state.json and the stores; `apr runs show` and the monitor show it."""

from __future__ import annotations

import pytest
from track_helpers import make_config

from apr.cli.cmd_runs import show_text
from apr.monitor.state import normalize
from apr.monitor.view import stats_lines
from apr.track.runs import show_run
from apr.track.state import read_state


def _metrics(step):
    return {"loss": 1.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "tokens_seen": step * 64}


def test_the_live_cost_is_elapsed_time_x_gpus_x_price(tmp_path, recorder_factory, monkeypatch):
    cfg = make_config(training={"log_interval": 1, "price_per_gpu_hour": 7200.0, "world_size": 4})
    rec = recorder_factory(tmp_path / "run", cfg)
    rec.start()
    for step in range(1, 4):
        rec.log_step(step, _metrics(step))
    rec.finish("finished")
    st = read_state(tmp_path / "run")
    cost = st["cost"]
    assert cost["price_per_gpu_hour"] == 7200.0 and cost["gpus"] == 4
    assert cost["spent"] == pytest.approx(st["elapsed_s"] * 4 * 2.0)  # 7200 per hour = 2 per second
    assert cost["projected"] is None or cost["projected"] >= cost["spent"]

    monkeypatch.chdir(tmp_path)
    detail = show_run(rec.run_id)
    recorded = detail["final_metrics"]["cost"]
    assert recorded["step"] == 3 and 0 < recorded["value"] <= cost["spent"]
    text = show_text(detail)
    assert "cost       " in text and "(7200 per GPU-hour x 4 GPU(s) x elapsed time)" in text

    rows = dict(stats_lines(normalize(st)[0]))
    assert rows["cost"].startswith(f"{cost['spent']:,.2f} so far") and "(7,200/GPU-hour x 4)" in rows["cost"]


def test_a_run_without_a_price_records_no_cost(tmp_path, recorder_factory, monkeypatch):
    rec = recorder_factory(tmp_path / "run")
    rec.start()
    rec.log_step(1, _metrics(1))
    rec.finish("finished")
    st = read_state(tmp_path / "run")
    assert st["cost"] is None and "cost" not in dict(stats_lines(normalize(st)[0]))
    monkeypatch.chdir(tmp_path)
    detail = show_run(rec.run_id)
    assert "cost" not in detail["final_metrics"] and "cost       " not in show_text(detail)
