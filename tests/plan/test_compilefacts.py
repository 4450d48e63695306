"""``training.execution.compile: auto`` in the plan (apr/plan/compilefacts.py): decided from a
probe's measured step time and the run's length, printed with its reason in the text and --json,
handed to the engine through the plan's policy; ``compile: true`` without a compiler is refused at
plan time with the fallback to use."""

from __future__ import annotations

import json

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
