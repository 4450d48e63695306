"""`apr train plan --probe`: the real engine measured beside the plan, the calibration store, and a
later plan that uses it; refusals."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from apr.cli.main import app
from apr.memory.table import memory_table
from apr.probe import run_probe
from apr.steps.execution import from_config
from apr.train.engine import Engine
from tests.train.run_helpers import make_dataset, write_config
from tests.train.tiny import make_config

runner = CliRunner()


@pytest.mark.parametrize("execution", [{"activations": "keep", "gradients": "kept"},
                                       {"activations": "recompute", "gradients": "workspace"}])
def test_measured_buffers_equal_the_buffer_plan_exactly(execution):
    config = make_config(training={"grad_clip": None, "execution": execution})
    policy = from_config(config)
    modelled = {r.component: r.bytes for r in memory_table(config, execution=policy)}
    result = run_probe(config, policy.to_dict(), modelled, steps=1)
    buffers = {r["component"]: r for r in result["rows"] if r["component"] != "transient"}
    assert {"weights", "adamw_m", "adamw_v", "gradients"} <= buffers.keys()
    assert all(r["measured"] == r["modelled"] for r in buffers.values())
    (transient,) = [r for r in result["rows"] if r["component"] == "transient"]
    assert transient["measured"] > 0 and transient["modelled"] == result["modelled_transient_bytes"]
    # every tensor is counted from the build on: the step's peak is the buffers, the step's own
    # tensors and little else (rope tables, flags)
    held = sum(r["measured"] for r in buffers.values()) + transient["measured"]
    assert 0 <= result["device_memory"]["tensor_peak_bytes"] - held < 0.01 * held
    assert result["tokens_per_s"] > 0 and result["device"] == "cpu" and result["versions"]["torch"]


def test_probe_records_a_calibration_that_the_next_plan_uses(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    before = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)
    assert "calibration" not in before["facts"] and before["facts"].get("time") is None  # CPU: no GPU peak
    r = runner.invoke(app, ["train", "plan", str(cfg), "--probe", "--probe-steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    probe = doc["facts"]["probe"]
    assert probe["calibration_id"] == 1 and doc["facts"]["calibration"]["probes"] == 1
    assert not (tmp_path / "run").exists()  # nothing written to the run's output folder
    after = runner.invoke(app, ["train", "plan", str(cfg)])
    assert after.exit_code == 0 and "Time (estimate, calibrated)" in after.stdout
    assert "calibrated from 1 probe on" in after.stdout
    seconds = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)["facts"]["time"]
    assert seconds["calibrated"] and seconds["base_kind"] == "probe"
    assert seconds["tokens_per_s"] == probe["tokens_per_s"]
    # the probe's step rate for the steps, plus its start-up (imports, plan, engine) and validation
    assert seconds["base_seconds"] >= 768 / probe["tokens_per_s"] + seconds["startup_seconds"]
    assert seconds["low_seconds"] < seconds["estimated_seconds"] < seconds["high_seconds"]
    assert seconds["assumes"]["threads"] == probe["threads"] >= 1 and seconds["assumes"]["device"] == "cpu"
    listed = json.loads(runner.invoke(app, ["calibration", "ls", "--json"]).stdout)
    assert [c["id"] for c in listed] == [1] and listed[0]["device"] == "cpu"
    shown = json.loads(runner.invoke(app, ["calibration", "show", "1", "--json"]).stdout)
    assert shown["result"]["tokens_per_s"] == probe["tokens_per_s"]
    missing = runner.invoke(app, ["calibration", "show", "7"])
    assert missing.exit_code == 1 and "no calibration 7" in missing.output and "Traceback" not in missing.output


def test_a_probe_of_a_sharded_multi_rank_plan_compares_with_one_process(tmp_path, monkeypatch):
    """The plan's table is one rank's shards at --world-size 2; the probe builds one unsharded
    process, so its buffers are compared with the model of one process and match exactly."""
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"sharding": "full"})
    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    r = runner.invoke(app, ["train", "plan", str(cfg), "--world-size", "2", "--probe", "--probe-steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    probe = doc["facts"]["probe"]
    buffers = [row for row in probe["rows"] if row["component"] != "transient"]
    assert buffers and all(row["measured"] == row["modelled"] for row in buffers), buffers
    assert probe["planned_world_size"] == 2
    sharded = {row["component"]: row["bytes"] for row in doc["memory"]["rows"]}  # one rank's of 2
    assert sharded["adamw_m"] < next(row["modelled"] for row in buffers if row["component"] == "adamw_m")
    text = runner.invoke(app, ["train", "plan", str(cfg), "--world-size", "2", "--probe", "--probe-steps", "1"]).stdout
    assert "one process, unsharded, against the model of one process" in text


def test_a_probe_that_runs_out_of_memory_names_the_step_and_exits_one(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    calls = []
    real = Engine.train_step

    def oom_on_second(self, micro, lr):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected")
        return real(self, micro, lr)

    monkeypatch.setattr(Engine, "train_step", oom_on_second)
    r = runner.invoke(app, ["train", "plan", str(cfg), "--probe"])
    assert r.exit_code == 1 and "out of memory during the memory step (step 2)" in r.output
    assert "Traceback" not in r.output
    assert json.loads(runner.invoke(app, ["calibration", "ls", "--json"]).stdout) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_probing_a_cuda_config_without_a_gpu_is_refused(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"device": "cuda", "mixed_precision": "bf16"})
    r = runner.invoke(app, ["train", "plan", str(cfg), "--probe"])
    assert r.exit_code == 1 and "no CUDA device" in r.output and "Traceback" not in r.output


def test_a_finished_run_calibrates_the_next_plan_with_its_own_throughput(tmp_path):
    from apr.apply import run_apply

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 12})
    result = run_apply(cfg, apr_home=None, echo=lambda line: None)
    assert result.status == "finished"
    (row,) = json.loads(runner.invoke(app, ["calibration", "ls", "--json"]).stdout)
    assert row["source"] == "run" and row["run_id"] == result.run_id and row["tokens_per_s"] > 0
    text = runner.invoke(app, ["train", "plan", str(cfg)]).stdout
    assert "calibrated from 1 run on" in text
    shown = runner.invoke(app, ["calibration", "show", str(row["id"])])
    assert shown.exit_code == 0 and f"from run {result.run_id}" in shown.stdout


def test_a_probe_plan_does_not_claim_a_warm_compile_cache_torch_s_default_folder_holds(tmp_path):
    """Torch points TORCHINDUCTOR_CACHE_DIR at its own /tmp folder when the probe imports inductor;
    the plan after the probe still judges the cache apply compiles into (apr's, here empty), never
    that one (issue 54 item 8)."""
    import getpass
    import os
    import subprocess
    import sys

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"execution": {"activations": "keep", "gradients": "kept",
                                                         "compile": "auto"}, "max_steps": 12})
    tmp = tmp_path / "tmp"
    torch_default = tmp / f"torchinductor_{getpass.getuser()}" / "fxgraph" / "ab"
    torch_default.mkdir(parents=True)
    (torch_default / "graph").write_bytes(b"someone else's graph")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TMPDIR=str(tmp), APR_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "apr", "train", "plan", str(cfg), "--probe", "--probe-steps", "1",
                           "--json"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr
    decision = json.loads(proc.stdout)["facts"]["execution"]["compile"]
    assert decision["cache"] == "cold", decision
    assert decision["cache_dir"] == str(tmp_path / "home" / "cache" / "inductor")
