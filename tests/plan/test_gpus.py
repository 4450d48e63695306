"""apr/plan/gpus.py: a CPU run with no GPU target is budgeted against this machine's RAM."""

from __future__ import annotations

from apr.plan.build import build_plan
from apr.plan.examples import materialize
from apr.plan.gpus import host_memory_bytes

HUGE = {"model": {"architecture": {"hidden_size": 65536, "num_hidden_layers": 64, "num_attention_heads": 512,
                                   "num_key_value_heads": 512, "intermediate_size": 262144}}}


def _codes(plan, severity="error"):
    return {f.code for f in plan.findings if f.severity == severity}


def test_a_cpu_run_larger_than_the_machines_ram_is_an_error(tmp_path):
    ram = host_memory_bytes()
    assert ram and ram > 2**28
    cfg, kw = materialize({"config": {**HUGE, "training": {"device": "cpu"}}}, tmp_path / "a")
    plan = build_plan(cfg, **kw)
    assert "C-MEM-001" in _codes(plan)  # was "0 errors" for a 4 TiB model on the CPU
    finding = next(f for f in plan.findings if f.code == "C-MEM-001")
    assert "this machine's RAM" in finding.message and plan.target.vram_bytes == ram


def test_a_small_cpu_run_fits_and_gpu_runs_keep_their_own_target(tmp_path):
    cfg, kw = materialize({"config": {"training": {"device": "cpu"}}}, tmp_path / "b")
    plan = build_plan(cfg, **kw)
    assert "C-MEM-001" not in _codes(plan) and plan.target is not None
    cfg, kw = materialize({"config": {**HUGE, "training": {"device": "cuda"}}}, tmp_path / "c")
    assert build_plan(cfg, **kw).target is None  # no GPU named: C-MEM-004 says so, as before


def test_device_auto_without_a_cuda_device_is_budgeted_like_a_cpu_run(tmp_path, monkeypatch):
    from apr.plan import gpus

    monkeypatch.setattr(gpus, "cuda_device_present", lambda: False)
    cfg, kw = materialize({"config": {**HUGE, "training": {"device": "auto"}}}, tmp_path / "d")
    plan = build_plan(cfg, **kw)
    assert "C-MEM-001" in _codes(plan)  # was "0 errors": auto had no target at all
    finding = next(f for f in plan.findings if f.code == "C-MEM-001")
    assert "this machine's RAM, training.device: auto, no CUDA device here" in finding.message
    monkeypatch.setattr(gpus, "cuda_device_present", lambda: True)  # auto will pick the GPU: no RAM budget
    assert build_plan(cfg, **kw).target is None


def test_cuda_presence_is_read_from_device_files_and_cuda_visible_devices(monkeypatch):
    from apr.plan import gpus

    monkeypatch.setattr(gpus.os, "listdir", lambda path: ["null", "nvidia0", "nvidiactl"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.cuda_device_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpus.cuda_device_present()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(gpus.os, "listdir", lambda path: ["null", "nvidiactl"])
    assert not gpus.cuda_device_present()
