"""A finished run calibrates later plans (apr/train/calibrate.py). Compiling is kept out of the step
time and the start-up it records and is recorded as its own term, with inductor's cache state, so
the run after a cold compiled one is not estimated several times too long (issue 54 item 8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from apr.plan.facts import calibrated_estimate
from apr.track import calibration
from apr.train import calibrate
from tests.train.tiny import make_config

THREADS = {"threads": 1, "cores": 2, "source": "auto"}


def _metric(start: float, seconds: float, hits: int = 0, misses: int = 0):
    return SimpleNamespace(start_time=start, duration_us=int(seconds * 1e6), inductor_fx_local_cache_hit_count=hits,
                           inductor_fx_local_cache_miss_count=misses)


def test_torch_still_reports_what_compiling_took_and_whether_the_cache_hit():
    from torch._dynamo import utils as dynamo_utils

    fields = set(dynamo_utils.CompilationMetrics.__dataclass_fields__)
    assert {"start_time", "duration_us", "inductor_fx_local_cache_hit_count",
            "inductor_fx_local_cache_miss_count"} <= fields
    assert callable(dynamo_utils.get_compilation_metrics)


def test_compile_time_is_split_at_the_loop_start_and_the_cache_state_read(monkeypatch):
    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics",
                        lambda: [_metric(100.0, 25.0, misses=2), _metric(140.0, 6.0, misses=1)])
    got = calibrate.compile_seconds(130.0)
    assert got == {"seconds": pytest.approx(31.0), "before": pytest.approx(25.0), "after": pytest.approx(6.0),
                   "cache": "cold"}
    assert calibrate.compile_seconds(130.0, only_after=True)["seconds"] == pytest.approx(6.0)
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: [_metric(100.0, 4.0, hits=3)])
    assert calibrate.compile_seconds(130.0)["cache"] == "warm"
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: [])
    assert calibrate.compile_seconds(130.0) == {"seconds": 0.0, "before": 0.0, "after": 0.0, "cache": None}


def _run(config, lines):
    execution = SimpleNamespace(to_dict=lambda: {"activations": "keep", "gradients": "kept", "compile": True})
    return SimpleNamespace(device=torch.device("cpu"), run_id="r1", tokens_per_step=64, dp=None, config=config,
                           engine=SimpleNamespace(execution=execution), echo=lines.append, plan_doc=None)


def test_a_cold_compiled_run_records_its_step_time_and_start_up_without_compiling(tmp_path, monkeypatch):
    """The run: 20 steps in a 10 s loop, 6 s of it compiling the graphs the loop met first; 40 s from
    the process's start to the loop, 25 s of it compiling block 0 (a cold cache)."""
    config = make_config()
    monkeypatch.setattr(calibrate, "STARTED_AT", 1000.0)
    monkeypatch.setattr(calibrate, "compile_seconds",
                        lambda since, only_after=False: {"seconds": 31.0, "before": 25.0, "after": 6.0,
                                                         "cache": "cold"})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    calibrate.record_run(_run(config, []), 10.0, 20, tmp_path, loop_started_at=1040.0)
    [row] = calibration.list_calibrations(tmp_path)
    result = row["result"]
    assert result["step_seconds"] == pytest.approx(4.0 / 20)  # not 10 s / 20
    assert result["tokens_per_s"] == pytest.approx(20 * 64 / 4.0)
    assert result["startup_seconds"] == pytest.approx(15.0)  # not 40 s
    assert (result["compile_seconds"], result["compile_cache"]) == (pytest.approx(31.0), "cold")
    assert result["compile_cache_dir"] == str(tmp_path / "inductor")
    assert result["actual_seconds"] == pytest.approx(50.0)  # the wall time, compiling included

    # the next compiled run of this shape, warm: its estimate is the run's rate and start-up plus a
    # warm compile, not the cold run's 50 s scaled up
    summary = calibration.summary([row])
    assert summary["compile"] == {"dirs": [str(tmp_path / "inductor")], "cold": pytest.approx(31.0)}
    compiling = {"seconds": 8.0, "cache": "warm", "cache_why": "", "source": "assumed for the device"}
    cfg = config.model_copy(update={"training": config.training.model_copy(update={"eval_interval": 0})})
    te = calibrated_estimate(cfg, 20 * 64, 1, summary, 1, "max_steps", 3.0, THREADS, load_now=summary["load"],
                             compiling=compiling)
    assert te["estimated_seconds"] == pytest.approx(4.0 + 15.0 + 8.0)
    assert te["base_seconds"] == pytest.approx(4.0 + 15.0)  # the correction never scales compiling
    assert te["compile_seconds"] == 8.0 and te["low_seconds"] > 8.0


def test_the_correction_a_compiled_run_teaches_leaves_its_compiling_out():
    """A run whose plan estimated 100 s of base and took 130 s, 30 of them compiling, ran as planned."""
    assert calibration._finished_ratio({"actual_seconds": 130.0, "base_seconds": 100.0,
                                        "compile_seconds": 30.0}) == pytest.approx(1.0)
    assert calibration._finished_ratio({"actual_seconds": 130.0, "base_seconds": 100.0}) == pytest.approx(1.3)


def test_the_planned_estimate_scales_with_the_steps_but_compiling_does_not():
    plan = {"facts": {"steps": {"total_steps": 100},
                      "time": {"estimated_seconds": 130.0, "low_seconds": 120.0, "high_seconds": 140.0,
                               "startup_seconds": 10.0, "compile_seconds": 20.0, "calibrated": True,
                               "base_seconds": 110.0, "base_kind": "probe"}}}
    got = calibrate.estimate_vs_actual(plan, 80.0, 50)
    assert got["estimated_seconds"] == pytest.approx(30.0 + 100.0 / 2)
    assert got["base_seconds"] == pytest.approx(10.0 + 100.0 / 2)
