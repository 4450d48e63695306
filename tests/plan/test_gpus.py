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
