"""The plan warns when this node's processes ask for more CPU threads than it has usable cores
(apr/plan/threadadvice.py), pointing at where the count came from, and its compile estimate does
not count threads the cores cannot run."""

from __future__ import annotations

from apr.plan.build import build_plan
from tests.train.run_helpers import make_dataset, write_config


def _two_cores(monkeypatch):
    monkeypatch.setattr("apr.threads.os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr("apr.threads.cgroup_cpu_limit", lambda *a, **k: None)
    for name in ("APR_CPU_THREADS", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _warnings(plan):
    return [f for f in plan.findings if f.code == "plan.threads_oversubscribed"]


def test_a_thread_count_from_the_environment_beyond_the_cores_is_a_warning(tmp_path, monkeypatch):
    _two_cores(monkeypatch)
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 4})
    assert _warnings(build_plan(cfg)) == []  # automatic: the cores
    monkeypatch.setenv("APR_CPU_THREADS", "64")
    plan = build_plan(cfg)
    (warning,) = _warnings(plan)
    assert warning.severity == "warning" and warning.path == "APR_CPU_THREADS" and warning.got == "64"
    assert "64 CPU threads on this node's 2 usable cores" in warning.message
    assert "x 2 threads" in plan.execution["compile"]["reason"]  # the estimate counts the cores, not 64


def test_a_configured_count_is_pointed_at_its_line_and_ranks_multiply_it(tmp_path, monkeypatch):
    _two_cores(monkeypatch)
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 4, "cpu_threads": 2})
    assert _warnings(build_plan(cfg)) == []  # one process, 2 threads, 2 cores
    (warning,) = _warnings(build_plan(cfg, world_size=2))  # two ranks on this node: 4 threads
    assert warning.path == "training.cpu_threads" and warning.line is not None and warning.got == "4"
    assert "2 x 2 ranks = 4 CPU threads" in warning.message and "at most 1 per process" in warning.message


def test_a_gpu_run_is_not_warned(tmp_path, monkeypatch):
    _two_cores(monkeypatch)
    make_dataset(tmp_path)
    monkeypatch.setenv("APR_CPU_THREADS", "64")
    cfg = write_config(tmp_path, training={"max_steps": 4, "device": "cuda", "mixed_precision": "bf16"})
    assert _warnings(build_plan(cfg)) == []
