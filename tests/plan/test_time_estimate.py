"""The calibrated time estimate (apr/plan/facts.py ``calibrated_estimate``): a point and a range that
says what it rests on. The point adds what a probe does not time (validation, start-up), follows
the finished runs' correction and the load's change; the range widens with each uncertainty."""

from __future__ import annotations

import math

import pytest

from apr.plan.facts import RANGE_FLOOR, calibrated_estimate, validations
from tests.train.tiny import make_config

THREADS = {"threads": 2, "cores": 2, "source": "auto"}


def _config(**training):
    cfg = make_config()
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=training),
                                  "data": cfg.data.model_copy(update={"val": "val/"})})


def _cal(**over) -> dict:
    return {"basis": "probe", "tokens_per_s": 1000.0, "step_seconds": 0.1, "startup_seconds": 5.0, "spread": 0.0,
            "load": 0.0, "basis_time": 0.0, "device_name": "x86_64", "what": "1 probe", "date": "2026-11-25",
            "correction": None, **over}


def test_a_quiet_probe_gives_compute_plus_validation_plus_startup_and_the_floor_range():
    cfg = _config(eval_interval=0)
    te = calibrated_estimate(cfg, 100_000, 1, _cal(), 1, "max_steps", 3.0, THREADS, load_now=0.0)
    assert te["compute_seconds"] == pytest.approx(100.0) and te["evaluation_seconds"] == 0.0
    assert te["estimated_seconds"] == pytest.approx(105.0) == te["base_seconds"]
    assert te["range_log_width"] == pytest.approx(RANGE_FLOOR)
    assert te["low_seconds"] == pytest.approx(105.0 * math.exp(-RANGE_FLOOR))
    assert te["high_seconds"] == pytest.approx(105.0 * math.exp(RANGE_FLOOR))
    a = te["assumes"]
    assert (a["threads"], a["cores"], a["device_name"], a["load_now"]) == (2, 2, "x86_64", 0.0)


def test_validation_is_counted_at_the_probes_forward_rate():
    cfg = _config(eval_interval=10, eval_batches=3)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.training.gradient_accumulation
    te = calibrated_estimate(cfg, 25 * tokens_per_step, 1, _cal(), 1, "max_steps", 3.0, THREADS, load_now=0.0)
    assert validations(cfg, 25) == 4  # step 0, 10, 20 and the last
    assert te["evaluation_seconds"] == pytest.approx(4 * 3 * 0.1 / 3.0)
    # a run-based calibration's rate already includes its validation
    runs = calibrated_estimate(cfg, 25 * tokens_per_step, 1, _cal(basis="run"), 1, "x", 3.0, THREADS, load_now=0.0)
    assert runs["evaluation_seconds"] == 0.0


def test_finished_runs_correct_the_point_and_their_spread_widens_the_range():
    cfg = _config(eval_interval=0)
    cal = _cal(correction={"factor": 1.3, "spread": 0.2, "runs": 3}, spread=0.15)
    te = calibrated_estimate(cfg, 100_000, 1, cal, 1, "x", 3.0, THREADS, load_now=0.0)
    assert te["estimated_seconds"] == pytest.approx(105.0 * 1.3) and te["assumes"]["correction_factor"] == 1.3
    assert te["range_log_width"] == pytest.approx(math.sqrt(0.15**2 + 0.2**2 + RANGE_FLOOR**2))
    assert te["loop_tokens_per_s"] == pytest.approx(1000.0 / 1.3)
    assert te["tokens_per_s_low"] < te["loop_tokens_per_s"] < te["tokens_per_s_high"]


def test_busier_cores_than_at_the_probe_slow_the_point_and_widen_the_range():
    cfg = _config(eval_interval=0)
    quiet = calibrated_estimate(cfg, 100_000, 1, _cal(load=0.0), 1, "x", 3.0, THREADS, load_now=0.0)
    busy = calibrated_estimate(cfg, 100_000, 1, _cal(load=0.0), 1, "x", 3.0, THREADS, load_now=2.0)
    assert busy["assumes"]["load_factor"] == pytest.approx(2.0)  # (2 + 2 threads) / 2 cores
    assert busy["compute_seconds"] == quiet["compute_seconds"]
    assert busy["estimated_seconds"] == pytest.approx(100.0 * 2.0 + 5.0)
    assert busy["range_widths"]["load"] > 0 and busy["range_log_width"] > quiet["range_log_width"]
    # a probe measured under the same load as now: its rate already includes it
    same = calibrated_estimate(cfg, 100_000, 1, _cal(load=2.0), 1, "x", 3.0, THREADS, load_now=2.0)
    assert same["estimated_seconds"] == pytest.approx(105.0)


def test_processes_divide_the_compute():
    cfg = _config(eval_interval=0)
    te = calibrated_estimate(cfg, 100_000, 1, _cal(), 4, "x", 3.0, THREADS, load_now=0.0)
    assert te["compute_seconds"] == pytest.approx(25.0) and te["gpus"] == 4


def test_a_gpu_estimate_has_no_load_terms():
    cfg = _config(eval_interval=0, device="cuda")
    te = calibrated_estimate(cfg, 100_000, 1, _cal(load=0.0), 1, "x", 3.0, THREADS, load_now=8.0)
    assert te["assumes"]["load_factor"] == 1.0 and te["range_widths"]["load"] == 0.0
    assert te["estimated_seconds"] == pytest.approx(105.0)
