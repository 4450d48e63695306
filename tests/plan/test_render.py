"""The plan's resources section says what the device is: host memory on the CPU (no CUDA context
counted), per GPU on a GPU (issue 39 item 7)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from apr.cli.main import app
from apr.memory.activations import COEFFICIENTS
from apr.plan import gpus
from apr.plan.build import build_plan
from apr.plan.examples import materialize
from apr.plan.render import render_text

runner = CliRunner()
GIB = 2**30


def _resources(text: str) -> tuple[str, list[str]]:
    """The resources heading and the component names of its table."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("Resources"))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("  ") or line.split()[0] == "total":
            break
        rows.append(line.split()[0])
    return lines[i].strip(), rows


def test_a_cpu_plan_shows_host_memory_without_a_cuda_context(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "host_memory_bytes", lambda: 16 * GIB)
    cfg, _ = materialize({}, tmp_path / "cpu")  # the base example trains on device: cpu
    plan = build_plan(cfg)
    head, rows = _resources(render_text(plan))
    assert head == "Resources (CPU, host memory; budget 16.00 GiB, this machine's RAM)"
    assert "cuda_context" not in rows and "weights" in rows and "allocator_slack" in rows
    assert "cuda_context" not in plan.facts["memory"]["by_component"]
    assert plan.facts["memory"]["total_bytes"] == sum(r.bytes for r in plan.memory)
    text = runner.invoke(app, ["train", "plan", str(cfg)]).stdout
    assert "Resources (CPU, host memory" in text and "per GPU" not in text and "cuda_context" not in text

    monkeypatch.setattr(gpus, "host_memory_bytes", lambda: None)  # RAM unknown: no budget to name
    head, _ = _resources(render_text(build_plan(cfg)))
    assert head == "Resources (CPU, host memory)"


def test_a_cpu_plan_at_several_ranks_says_per_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "host_memory_bytes", lambda: None)
    cfg, kwargs = materialize({"world_size": 2}, tmp_path / "cpu2")
    head, _ = _resources(render_text(build_plan(cfg, **kwargs)))
    assert head == "Resources (CPU, host memory per rank)"


def test_a_gpu_plan_is_per_gpu_and_counts_the_cuda_context(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "cuda_device_present", lambda: True)  # device auto would find a GPU
    for device in ("cuda", "auto"):
        cfg, _ = materialize({"config": {"training": {"device": device}}}, tmp_path / device)
        plan = build_plan(cfg, gpu="RTX 4090")
        head, rows = _resources(render_text(plan))
        assert head == "Resources per GPU (target: NVIDIA GeForce RTX 4090 24GB, 23.99 GiB, from --gpu)"
        assert "cuda_context" in rows
        assert plan.facts["memory"]["by_component"]["cuda_context"] == COEFFICIENTS.cuda_context_bytes
        head, rows = _resources(render_text(build_plan(cfg)))
        assert head == "Resources per GPU (no target: pass --gpu NAME or --vram SIZE to compare)"
        assert "cuda_context" in rows


def test_device_auto_without_a_cuda_device_says_it_plans_the_host(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "cuda_device_present", lambda: False)
    monkeypatch.setattr(gpus, "host_memory_bytes", lambda: 16 * GIB)
    cfg, _ = materialize({"config": {"training": {"device": "auto"}}}, tmp_path / "auto")
    head, _ = _resources(render_text(build_plan(cfg)))
    assert head == ("Resources (CPU here: training.device auto finds no CUDA device, host memory; "
                    "budget 16.00 GiB, this machine's RAM)")


def test_a_cpu_config_compared_with_a_gpu_says_no_cuda_context_is_counted(tmp_path):
    cfg, _ = materialize({}, tmp_path / "cpu")
    plan = build_plan(cfg, gpu="RTX 4090")
    head, rows = _resources(render_text(plan))
    assert head == ("Resources per GPU (target: NVIDIA GeForce RTX 4090 24GB, 23.99 GiB, from --gpu; "
                    "training.device cpu: no CUDA context counted)")
    assert "cuda_context" not in rows


def test_a_first_cpu_plan_names_probe_and_its_json_has_no_gpu_memory_terms(tmp_path, monkeypatch):
    """A first CPU plan (no calibration yet) said `pass --gpu NAME`; its JSON carried the CUDA
    context's coefficient and a caching-allocator row (issue 54 item 10)."""
    import json

    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))  # no calibration rows
    monkeypatch.setattr(gpus, "host_memory_bytes", lambda: 16 * GIB)
    cfg, _ = materialize({}, tmp_path / "cpu")
    plan = build_plan(cfg)
    text = render_text(plan)
    time_lines = text.split("Time (estimate)", 1)[1].splitlines()
    assert "pass --probe" in time_lines[1] and "--gpu" not in time_lines[1], time_lines[:2]
    doc = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)
    assert "cuda_context_bytes" not in doc["memory"]["coefficients"]
    assert not any("caching-allocator" in r["detail"] for r in doc["memory"]["rows"])
    gpu_cfg, _ = materialize({"config": {"training": {"device": "cuda"}}}, tmp_path / "gpu")
    gpu_doc = json.loads(runner.invoke(app, ["train", "plan", str(gpu_cfg), "--json", "--gpu", "4090"]).stdout)
    assert gpu_doc["memory"]["coefficients"]["cuda_context_bytes"] == COEFFICIENTS.cuda_context_bytes
    assert any("caching-allocator" in r["detail"] for r in gpu_doc["memory"]["rows"])


def test_a_time_conditioned_plan_counts_the_time_embedding_and_names_the_steps(tmp_path):
    """model.architecture.time: the parameter split shows the time embedding (the learned table and
    the projection), and the plan's line names its FLOP/token and the step of each stage (depth) or of
    validation and generation (input)."""
    from apr.config.schema import AprConfig

    time = {"embedding_dim": 8, "encoding": "learned", "num_time_steps": 100, "eval_time": 0.3}
    cfg, _ = materialize({"config": {"model": {"architecture": {"time": time}}, "training": {"engine": "standard"}}},
                         tmp_path / "input")
    plan = build_plan(cfg)
    arch = AprConfig.model_validate(plan.config.model_dump(mode="json")).model.architecture
    facts = plan.facts["model"]["time"]
    assert facts["params"] == 100 * 8 + arch.hidden_size * 8 and facts["eval_step"] == 30
    text = render_text(plan)
    assert re.search(r"embedding \+ [\d.]+K time \+ [\d.]+K LM head", text), text
    assert "time conditioning (input): learned encoding 8 wide over 100 steps" in text
    assert "validation and generation at step 30" in text
