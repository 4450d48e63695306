"""``training.execution.compile: auto`` in the plan (apr/plan/compilefacts.py): decided from a
probe's measured step time and the run's length, printed with its reason in the text and --json,
handed to the engine through the plan's policy; ``compile: true`` without a compiler is refused at
plan time with the fallback to use."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr import __version__
from apr.cli.main import app
from apr.config import load_config
from apr.plan.build import build_plan
from apr.plan.facts import cpu_threads
from apr.plan.render import render_json, render_text
from apr.track import calibration
from tests.train.run_helpers import make_dataset, write_config

runner = CliRunner()


def _probe(step_seconds: float) -> dict:
    return {"source": "probe", "device": "cpu", "device_name": calibration.host_cpu_name(),
            "versions": {"torch": calibration.torch_version(), "cuda": None, "apr": __version__, "python": "3"},
            "tokens_per_s": 64 / step_seconds, "step_seconds": step_seconds, "step_seconds_all": [step_seconds],
            "startup_seconds": 2.0, "load": 0.5, "threads": 1, "rows": []}


def _record(cfg, step_seconds: float, compiled: bool) -> None:
    config = load_config(cfg).config
    policy = {"activations": "keep", "gradients": "kept", "compile": compiled, "kept_blocks": 2,
              "recomputed_blocks": 0, "recompute": "none"}
    calibration.record(_probe(step_seconds), calibration.shape(config, policy, cpu_threads(config, 1)["threads"]))


def test_plan_compiles_a_long_measured_cpu_run_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr("apr.plan.compilefacts.policy.compile_problem", lambda device: None)
    make_dataset(tmp_path)
    settings = {"execution": {"activations": "keep", "gradients": "kept", "compile": "auto"}}
    short = write_config(tmp_path, "short.yaml", training={**settings, "max_steps": 10})
    long = write_config(tmp_path, "long.yaml", training={**settings, "epochs": 5000, "max_steps": 100_000})
    plan = build_plan(long)  # no probe: the step's FLOPs at an assumed CPU rate (a tiny model: microseconds)
    assert "estimated at an assumed 50GFLOP/s x" in plan.execution["compile"]["reason"]
    assert plan.resolved.execution.compile is False
    _record(long, 3.0, compiled=False)  # a probe of the eager policy: 3 s a step

    plan = build_plan(long)
    decision = plan.execution["compile"]
    assert decision["compile"] and plan.execution["policy"]["compile"] is True
    assert plan.resolved.execution.compile is True  # what apply hands to the engine
    assert decision["step_seconds"] == 3.0 and "measured: 1 probe" in decision["reason"]
    assert "blocks auto -> compiled: 100,000 steps x 3 s (measured: 1 probe)" in render_text(plan)
    assert json.loads(render_json(plan))["facts"]["execution"]["compile"]["compile"] is True

    assert build_plan(short).resolved.execution.compile is False  # 10 steps cannot repay compiling
    _record(long, 3.3, compiled=True)  # compiled measured slower here: auto believes the measurement
    decision = build_plan(long).execution["compile"]
    assert not decision["compile"] and decision["saving_source"] == "measured by probes of both"


def test_compile_true_without_a_compiler_fails_the_plan_naming_the_fallback(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"execution": {"compile": True}})
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    result = runner.invoke(app, ["train", "plan", str(cfg)])
    assert result.exit_code == 1
    assert "training.execution.compile" in result.output and "no-such-compiler-xyz is not on PATH" in result.output
    assert "set it to false (or auto" in result.output
    auto = write_config(tmp_path, "auto.yaml", training={"execution": {"compile": "auto"}, "epochs": 5000,
                                                              "max_steps": 100_000})
    _record(auto, 3.0, compiled=False)
    plan = build_plan(auto)  # auto falls back to eager blocks, with the reason
    assert not plan.errors and plan.execution["compile"]["compile"] is False
    assert "no-such-compiler-xyz is not on PATH" in plan.execution["compile"]["reason"]


def _record_compiled_run(cfg, step_seconds: float, compile_seconds: float, cache: str, cache_dir) -> None:
    """A finished compiled run of ``cfg``'s shape as apr/train/calibrate.py records it: its step time
    and start-up without compiling, compiling as its own figures."""
    config = load_config(cfg).config
    policy = {"activations": "keep", "gradients": "kept", "compile": True, "kept_blocks": 2,
              "recomputed_blocks": 0, "recompute": "none"}
    result = {**_probe(step_seconds), "source": "run", "run_id": "r", "steps": 40, "seconds": 40 * step_seconds,
              "compile_seconds": compile_seconds, "compile_cache": cache, "compile_cache_dir": str(cache_dir)}
    calibration.record(result, calibration.shape(config, policy, cpu_threads(config, 1)["threads"]))


def test_compiled_steps_measured_slower_keep_auto_eager_without_a_negative_saving(tmp_path, monkeypatch):
    monkeypatch.setattr("apr.plan.compilefacts.policy.compile_problem", lambda device: None)
    make_dataset(tmp_path)
    long = write_config(tmp_path, "long.yaml", training={"execution": {"activations": "keep", "gradients": "kept",
                                                                       "compile": "auto"},
                                                         "epochs": 5000, "max_steps": 100_000})
    _record(long, 1.0, compiled=False)
    _record_compiled_run(long, 1.5, 30.0, "cold", tmp_path / "inductor")
    decision = build_plan(long).execution["compile"]
    assert decision["compile"] is False
    assert "compiled steps measured 50.0% slower than eager ones" in decision["reason"]
    assert "-" not in decision["reason"].split("slower")[0]  # never "x -50% saved"


def test_the_compile_cache_is_checked_not_assumed(tmp_path, monkeypatch):
    """Warm only when the folder apply compiles into holds graphs that a compiled probe or run of this
    shape put there; another shape's graphs, empty folders and locks are a cold cache."""
    monkeypatch.setattr("apr.plan.compilefacts.policy.compile_problem", lambda device: None)
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"execution": {"activations": "keep", "gradients": "kept",
                                                         "compile": "auto"}, "epochs": 5000, "max_steps": 100_000})
    _record(cfg, 3.0, compiled=False)
    (cache / "fxgraph" / "xy").mkdir(parents=True)
    (cache / "locks").mkdir()
    assert build_plan(cfg).execution["compile"]["cache"] == "cold"  # folders, no graph
    (cache / "fxgraph" / "xy" / "graph").write_bytes(b"another shape's graph")
    assert build_plan(cfg).execution["compile"]["cache"] == "cold"  # nothing of this shape filled it
    _record_compiled_run(cfg, 2.0, 30.0, "cold", cache)
    decision = build_plan(cfg).execution["compile"]
    assert decision["cache"] == "warm" and decision["cache_dir"] == str(cache)


def test_a_compiled_plan_estimates_compiling_as_its_own_term(tmp_path, monkeypatch):
    """After a cold compiled run, the next compiled run of the shape is estimated from the run's step
    time plus compiling at the cache's state, not from its wall time (issue 54 item 8)."""
    monkeypatch.setattr("apr.plan.compilefacts.policy.compile_problem", lambda device: None)
    monkeypatch.setattr("apr.steps.execution.compile_problem", lambda device: None)
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"execution": {"activations": "keep", "gradients": "kept",
                                                         "compile": True}, "max_steps": 40, "epochs": 100,
                                           "eval_interval": 0})
    _record_compiled_run(cfg, 0.5, 31.0, "cold", cache)
    (cache / "fxgraph" / "xy").mkdir(parents=True)
    (cache / "fxgraph" / "xy" / "graph").write_bytes(b"this shape's graph")
    plan = build_plan(cfg)
    t = plan.facts["time"]
    assert t["compile"]["cache"] == "warm" and t["compile"]["source"] == "assumed for the device"
    assert t["compile_seconds"] == 8.0  # no warm compile measured yet: the CPU's assumed warm cost
    assert t["estimated_seconds"] == pytest.approx(40 * 0.5 + 2.0 + 8.0, rel=0.01)  # steps + start-up + compiling
    assert "+ 8.0 s compiling (warm cache: assumed for the device)" in render_text(plan)
    _record_compiled_run(cfg, 0.5, 6.0, "warm", cache)
    t = build_plan(cfg).facts["time"]
    assert t["compile_seconds"] == 6.0 and t["compile"]["source"].startswith("measured")
