"""The CPU thread policy (apr/threads.py): what a user or torchrun sets wins in a stated order, the
automatic choice divides the cores this process may use among the ranks on the node, and bad
values are refused with the variable's name."""

from __future__ import annotations

import os

import pytest

from apr import threads
from apr.errors import AprError


def _cores() -> int:
    return threads.usable_cores()[0]


def test_auto_divides_the_usable_cores_among_the_ranks_on_the_node():
    one = threads.choose(world_size=1, environ={})
    assert one["source"] == "auto" and one["threads"] == _cores() and one["ranks_per_node"] == 1
    # torchrun's LOCAL_WORLD_SIZE is the ranks sharing this host's cores
    shared = threads.choose(world_size=8, nodes=2, environ={"LOCAL_WORLD_SIZE": str(_cores() * 4)})
    assert shared["threads"] == 1 and shared["ranks_from"] == "LOCAL_WORLD_SIZE"
    # the plan, before torchrun exists: world_size / nodes ranks per host
    planned = threads.choose(world_size=2 * _cores(), nodes=1, environ={})
    assert planned["ranks_per_node"] == 2 * _cores() and planned["threads"] == 1


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    assert threads.usable_cores(quota=1.5)[0] == min(2, len(os.sched_getaffinity(0)))
    v2 = tmp_path / "cpu.max"
    v2.write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(v2) == 1.5
    v2.write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(v2, (tmp_path / "none", tmp_path / "none")) is None
    quota, period = tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    quota.write_text("200000\n")
    period.write_text("100000\n")
    assert threads.cgroup_cpu_limit(tmp_path / "missing", (quota, period)) == 2.0
    quota.write_text("-1\n")  # cgroup v1: no limit
    assert threads.cgroup_cpu_limit(tmp_path / "missing", (quota, period)) is None


def test_overrides_win_in_order_env_then_config_then_omp():
    both = {"APR_CPU_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert threads.choose(7, environ=both)["threads"] == 3
    config = threads.choose(7, environ={"OMP_NUM_THREADS": "5"})
    assert config["threads"] == 7 and config["source"] == "training.cpu_threads"
    omp = threads.choose(None, environ={"OMP_NUM_THREADS": "5"})
    assert omp["threads"] == 5 and omp["source"] == "env OMP_NUM_THREADS"
    # torchrun sets OMP_NUM_THREADS=1 for every multi-rank launch: the policy replaces it
    under_torchrun = threads.choose(None, world_size=2, environ={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"})
    assert under_torchrun["source"] == "auto" and under_torchrun["threads"] == _cores()


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", " "])
def test_a_bad_thread_override_names_the_variable(value):
    with pytest.raises(AprError) as err:
        threads.choose(None, environ={"APR_CPU_THREADS": value, "LOCAL_WORLD_SIZE": "1"} if value.strip()
                       else {"OMP_NUM_THREADS": value + "x"})
    finding = err.value.findings[0]
    assert finding.path in ("APR_CPU_THREADS", "OMP_NUM_THREADS") and "whole number of threads" in err.value.message


def test_the_config_key_is_read_and_the_choice_described(tmp_path):
    from tests.train.tiny import make_config

    cfg = make_config()
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"cpu_threads": 1})})
    choice = threads.for_config(cfg)
    assert choice["threads"] == 1 and choice["source"] in ("training.cpu_threads", "env APR_CPU_THREADS")
    assert threads.describe(choice).startswith("1 CPU thread per process")


def test_apply_sets_torch_and_records_the_choice(monkeypatch):
    import torch

    from tests.train.tiny import make_config

    before = torch.get_num_threads()
    monkeypatch.setenv("APR_CPU_THREADS", "1")
    try:
        got = threads.apply_thread_policy(make_config(), 1)
        assert torch.get_num_threads() == 1 and got["threads"] == 1 and got["torch_default"] == before
        assert threads.applied()["threads"] == 1 and "load" in got
    finally:
        torch.set_num_threads(before)


def test_waiting_threads_spin_on_free_cores_and_sleep_once_other_work_fills_them():
    quiet = threads.wait_policy(0.3, 2, {})
    assert quiet["policy"] == "ACTIVE" and quiet["source"] == "auto" and "0.30 < 2 cores" in quiet["why"]
    assert threads.wait_policy(1.99, 2, {})["policy"] == "ACTIVE"
    assert threads.wait_policy(2.0, 2, {})["policy"] == "PASSIVE"
    busy = threads.wait_policy(6.2, 2, {})
    assert busy["policy"] == "PASSIVE" and "6.20 >= 2 cores" in busy["why"]
    assert threads.wait_policy(6.2, 64, {})["policy"] == "ACTIVE"  # the load is out of the machine's cores
    assert threads.wait_policy(None, 2, {})["policy"] is None  # no load average: OpenMP's own default


def test_a_minutes_load_that_has_gone_does_not_make_threads_sleep():
    # the last minute was busy, and other processes fill the cores now too: sleep
    assert threads.wait_policy(4.0, 2, {}, running_now=3.2)["policy"] == "PASSIVE"
    assert threads.wait_policy(4.0, 2, {}, running_now=2.0)["policy"] == "PASSIVE"
    # busy a minute ago (a sweep's previous trial, a benchmark's previous variant), free cores now: spin
    gone = threads.wait_policy(2.3, 2, {}, running_now=0.2)
    assert gone["policy"] == "ACTIVE" and "0.2 other processes runnable now" in gone["why"]
    assert threads.wait_policy(4.0, 2, {}, running_now=1.4)["policy"] == "ACTIVE"
    assert threads.wait_policy(70.0, 64, {}, running_now=63.0)["policy"] == "ACTIVE"
    assert threads.wait_policy(70.0, 64, {}, running_now=64.0)["policy"] == "PASSIVE"


def test_work_that_just_started_makes_threads_sleep_before_the_minutes_load_shows_it():
    # four busy processes started a second ago: the minute still reads 0.23, the cores are full now
    fresh = threads.wait_policy(0.23, 2, {}, running_now=4.0)
    assert fresh["policy"] == "PASSIVE" and "4.0 other processes runnable now >= 2 cores" in fresh["why"]
    assert threads.wait_policy(0.23, 2, {}, running_now=1.0)["policy"] == "ACTIVE"  # one rank beside: free


def test_set_wait_policy_reads_the_runnable_count_once_and_confirms_a_busy_reading(monkeypatch):
    calls = []

    def reading(samples: int = 5, interval_s: float = 0.004, path: str = "/proc/loadavg"):
        calls.append(samples)
        return {1: 3.0, 5: 2.4}[samples] if busy else 0.0

    monkeypatch.setattr(threads, "running_now", reading)
    monkeypatch.setattr(threads, "system_cores", lambda: 2)
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)  # as if torch were not loaded yet
    busy = False
    assert threads.set_wait_policy({}, load=0.1)["policy"] == "ACTIVE" and calls == [1]  # quiet: one cheap read
    busy, calls[:] = True, []
    decided = threads.set_wait_policy({}, load=0.1)
    assert decided["policy"] == "PASSIVE" and calls == [1, 5] and decided["running_now"] == 2.4


def test_running_now_reads_the_kernels_runnable_count_less_this_process(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("5.10 4.20 3.90 4/312 9876\n")
    assert threads.running_now(samples=3, interval_s=0, path=str(loadavg)) == 3.0
    loadavg.write_text("0.01 0.02 0.03 1/80 9876\n")
    assert threads.running_now(samples=2, interval_s=0, path=str(loadavg)) == 0.0
    assert threads.running_now(path=str(tmp_path / "missing")) is None  # no /proc: the minute's load alone


def test_the_users_wait_policy_wins_and_a_parents_choice_is_made_again():
    for load in (0.0, 9.0):
        mine = threads.wait_policy(load, 2, {"OMP_WAIT_POLICY": "ACTIVE"})
        assert mine["policy"] == "ACTIVE" and mine["source"] == "env OMP_WAIT_POLICY"
    # apr set PASSIVE in the process that started this one (the plan, before its probe): decide anew
    inherited = {"OMP_WAIT_POLICY": "PASSIVE", "APR_OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.wait_policy(0.1, 2, inherited) == threads.wait_policy(0.1, 2, {})
    # torch loaded before apr: OpenMP has read the variable already, nothing apr sets would count
    late = threads.wait_policy(0.1, 2, {}, torch_loaded=True)
    assert late["policy"] is None and late["source"] == "torch loaded first"


def test_set_wait_policy_writes_the_choice_marked_as_aprs(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)  # as if torch were not loaded yet
    env: dict = {}
    assert threads.set_wait_policy(env, load=0.0, running=None)["policy"] == "ACTIVE"
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "APR_OMP_WAIT_POLICY": "ACTIVE"}
    busy = threads.set_wait_policy(env, load=50.0, running=49.0)
    assert busy["policy"] == "PASSIVE" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert threads.set_wait_policy(env, load=None, running=None)["policy"] is None and env == {}  # apr's, taken back
    mine = {"OMP_WAIT_POLICY": "passive"}
    assert threads.set_wait_policy(mine, load=0.0, running=None)["policy"] == "passive"
    assert mine == {"OMP_WAIT_POLICY": "passive"}


def test_contention_counts_only_beyond_the_cores():
    assert threads.contention(0.0, 2, 2) == 1.0 and threads.contention(None, 1, 2) == 1.0
    assert threads.contention(4.0, 2, 2) == 3.0
