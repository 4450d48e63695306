"""The CPU thread policy: how many intra-op threads torch runs with, chosen deliberately and
recorded (docs/performance.md, "CPU threads").

torch's default is one intra-op thread per core it sees, whatever else runs: two ranks on a 2-core
host then run four threads that spin for two cores, and a loaded machine makes every step wait for
its slowest thread. apr decides instead, in this order:

1. ``APR_CPU_THREADS`` in the environment (``apr train plan --cpu-threads N`` sets it);
2. ``training.cpu_threads`` in the config;
3. ``OMP_NUM_THREADS`` when the user set it outside torchrun (torchrun sets it to 1 for every
   multi-rank launch, so under torchrun the policy below replaces it);
4. auto: the cores this process may use (``os.sched_getaffinity``, capped by a cgroup CPU quota)
   divided by the ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; the plan's
   ``world_size / nodes``), at least 1.

Torch-free: the plan and ``validate`` compute the same choice without importing torch; only
``apply_thread_policy`` (apply and the probe) hands it to torch.

How waiting threads wait (``OMP_WAIT_POLICY``) is chosen from what the machine is doing when the
process starts, before torch loads (OpenMP reads the variable once, when torch loads): importing
this module sets it, unless the user set it or torch is already loaded (``wait_policy`` decides,
a pure function of the load, the cores and the environment). While the 1-minute load average is
below the machine's cores, waiting threads spin (ACTIVE: the fastest on cores that are free);
once other work alone fills every core they sleep (PASSIVE). Spinning threads on busy cores wait
for each other at every parallel region: on a 2-core machine with a load of 6 that made a 0.36 s
step take 7.3 s; sleeping on free cores cost a third of the speed (docs/performance.md, "CPU
threads"). apply, plan and the probe import this module before torch; a child process (the
probe, torchrun's ranks) decides again, since it inherits apr's choice marked as apr's
(``APR_OMP_WAIT_POLICY``), not the user's.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from apr.errors import AprError, Finding

ENV = "APR_CPU_THREADS"
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
_applied: dict | None = None  # the last choice handed to torch in this process
WAIT_ENV = "OMP_WAIT_POLICY"
WAIT_MARK = "APR_OMP_WAIT_POLICY"  # set beside OMP_WAIT_POLICY when apr chose it, so children re-decide
_wait: dict | None = None  # this process's wait-policy decision (set_wait_policy)


def system_cores() -> int:
    """Every CPU the machine has online: what the load average (a whole-machine count) is out of."""
    return max(1, os.cpu_count() or 1)


def wait_policy(load: float | None, cores: int, environ, torch_loaded: bool = False,
                running_now: float | None = None) -> dict:
    """How OpenMP's waiting threads should wait: ``policy`` (ACTIVE, PASSIVE, or None for OpenMP's
    own default), ``source`` and ``why``. The user's ``OMP_WAIT_POLICY`` wins (one apr set in a
    parent process, marked by ``APR_OMP_WAIT_POLICY``, does not); torch loaded first leaves
    OpenMP's default (it has read the variable already); an unknown load leaves OpenMP's default
    too. Otherwise the machine's state now decides where the OS says it (``running_now``, other
    processes runnable at this moment; None where it does not): PASSIVE when they fill the cores
    (``cores``, the machine's), else ACTIVE, whatever the 1-minute load average (``load``) says. The
    minute lags both ways: a process started right after another busy one (a sweep's next trial, a
    benchmark's next variant) would read that one's minute as other work, and one started just
    after other work began would read the quiet minute before it (docs/performance.md, "CPU
    threads"). Without ``running_now`` the minute decides: PASSIVE once ``load`` reaches ``cores``.
    Pure: the caller reads the load, the runnable count and the cores."""
    user = environ.get(WAIT_ENV)
    base = {"load": load, "running_now": running_now, "cores": cores}
    if user and environ.get(WAIT_MARK) != user:
        return {**base, "policy": user, "source": f"env {WAIT_ENV}", "why": "set by the user"}
    if torch_loaded:
        return {**base, "policy": user or None, "source": "torch loaded first",
                "why": "torch was loaded before apr could choose: OpenMP's own"}
    if load is None:
        return {**base, "policy": None, "source": "auto", "why": "no load average on this OS: OpenMP's own"}
    if running_now is not None:
        if running_now >= cores:
            return {**base, "policy": "PASSIVE", "source": "auto",
                    "why": f"{running_now:.1f} other processes runnable now >= {cores} cores (load {load:.2f}): "
                           "other work fills them, waiting threads sleep"}
        return {**base, "policy": "ACTIVE", "source": "auto",
                "why": f"{running_now:.1f} other processes runnable now < {cores} cores (load {load:.2f}): "
                       "free cores, waiting threads spin"}
    if load < cores:
        return {**base, "policy": "ACTIVE", "source": "auto",
                "why": f"load {load:.2f} < {cores} cores: free cores, waiting threads spin"}
    return {**base, "policy": "PASSIVE", "source": "auto",
            "why": f"load {load:.2f} >= {cores} cores: other work fills them, waiting threads sleep"}


def running_now(samples: int = 5, interval_s: float = 0.004, path: str = "/proc/loadavg") -> float | None:
    """Other processes runnable at this moment: the mean over ``samples`` readings of the kernel's
    count of runnable tasks (the fourth field of /proc/loadavg, which counts this process too), or
    None where there is no such file."""
    counts = []
    for i in range(samples):
        try:
            with open(path) as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(0.0, sum(counts) / len(counts))


def set_wait_policy(environ=None, load: float | None | str = "now", running: float | None | str = "now") -> dict:
    """Decide ``OMP_WAIT_POLICY`` for this process (``wait_policy`` on the load of this moment) and
    put it in ``environ`` (default ``os.environ``), marked as apr's; returns the decision."""
    global _wait
    env = os.environ if environ is None else environ
    load = load_average() if load == "now" else load
    if running == "now":  # one reading; where it says busy, 5 over ~20 ms to confirm it
        running = running_now(samples=1) if load is not None else None
        if running is not None and running >= system_cores():
            running = running_now()
    choice = wait_policy(load, system_cores(), env, torch_loaded="torch" in sys.modules, running_now=running)
    if choice["source"] == "auto":
        if choice["policy"]:
            env[WAIT_ENV] = env[WAIT_MARK] = choice["policy"]
        elif env.get(WAIT_MARK) is not None:  # a parent's choice, and none to replace it with here
            env.pop(WAIT_ENV, None)
            env.pop(WAIT_MARK, None)
    if environ is None:
        _wait = choice
    return choice


def wait_decision() -> dict | None:
    """This process's wait-policy decision (made when this module was imported)."""
    return None if _wait is None else dict(_wait)


def cgroup_cpu_limit(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> float | None:
    """The CPU quota of this process's cgroup in cores (``cpu.max`` "200000 100000" = 2.0), or None
    when there is none ("max", -1) or it cannot be read."""
    try:
        quota, period = v2.read_text().split()[:2]
        if quota != "max" and float(period) > 0:
            return float(quota) / float(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = (float(p.read_text().strip()) for p in v1)
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(quota: float | None = None) -> tuple[int, str]:
    """The cores this process may run on, and how that was found."""
    try:
        cores, how = len(os.sched_getaffinity(0)), "sched_getaffinity"
    except (AttributeError, OSError):  # macOS, Windows
        cores, how = os.cpu_count() or 1, "os.cpu_count"
    quota = cgroup_cpu_limit() if quota is None else quota
    if quota is not None and math.ceil(quota) < cores:
        cores, how = max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g} cores"
    return max(1, cores), how


def _positive_int(text: str, source: str) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        message = f"{source} must be a whole number of threads >= 1, got {text!r}"
        raise AprError(message, [Finding("error", "threads.bad_value", message, path=source,
                                         expected="an integer >= 1", got=repr(text))])
    return value


def ranks_on_this_node(world_size: int = 1, nodes: int = 1, environ=None) -> tuple[int, str]:
    """Processes sharing this host's cores: torchrun's LOCAL_WORLD_SIZE at run time, else the
    plan's ranks per node (world_size / nodes, rounded up)."""
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE")
    if local:
        try:
            return max(1, int(local)), "LOCAL_WORLD_SIZE"
        except ValueError:
            pass
    per_node = max(1, math.ceil(max(1, world_size) / max(1, nodes)))
    return per_node, "world_size / nodes" if per_node > 1 else "one process"


def choose(config_threads: int | None = None, *, world_size: int = 1, nodes: int = 1,
           environ=None, quota: float | None = None) -> dict:
    """The thread choice and what it rests on: ``threads``, ``source`` (env, config, omp, auto),
    ``cores``, ``cores_from``, ``ranks_per_node``, ``ranks_from``. Pure apart from reading the
    affinity, the cgroup and the environment."""
    env = os.environ if environ is None else environ
    cores, cores_from = usable_cores(quota)
    ranks, ranks_from = ranks_on_this_node(world_size, nodes, env)
    out = {"cores": cores, "cores_from": cores_from, "ranks_per_node": ranks, "ranks_from": ranks_from}
    if env.get(ENV):
        return {**out, "threads": _positive_int(env[ENV], ENV), "source": f"env {ENV}"}
    if config_threads is not None:
        return {**out, "threads": int(config_threads), "source": "training.cpu_threads"}
    if env.get("OMP_NUM_THREADS") and not env.get("LOCAL_WORLD_SIZE"):
        return {**out, "threads": _positive_int(env["OMP_NUM_THREADS"], "OMP_NUM_THREADS"),
                "source": "env OMP_NUM_THREADS"}
    return {**out, "threads": max(1, cores // ranks), "source": "auto"}


def for_config(config, world_size: int | None = None, nodes: int | None = None) -> dict:
    """The choice for a run of ``config`` at ``world_size`` ranks on ``nodes`` hosts (default: the
    config's own)."""
    tr = config.training
    return choose(tr.cpu_threads, world_size=world_size or tr.world_size,
                  nodes=nodes or tr.nodes)


def describe(choice: dict) -> str:
    """One line for the plan, the probe and the run's banner."""
    n = choice["threads"]
    if choice["source"] == "auto":
        cores, ranks = choice["cores"], choice["ranks_per_node"]
        why = (f"auto: {cores} usable core{'s' if cores != 1 else ''} ({choice['cores_from']}) / "
               f"{ranks} rank{'s' if ranks != 1 else ''} per node")
    else:
        why = f"from {choice['source']}; {choice['cores']} usable cores"
    wait = os.environ.get(WAIT_ENV)
    decided = _wait or {}
    how = (f"{decided['source']}, {decided['why']}" if decided.get("source") == "auto" and decided.get("policy")
           else decided.get("source", ""))
    return f"{n} CPU thread{'s' if n != 1 else ''} per process ({why})" + (
        f"; waiting threads {'sleep' if wait.upper() == 'PASSIVE' else 'spin'} ({WAIT_ENV}={wait}"
        f"{'; ' + how if how else ''})" if wait else "")


def apply_thread_policy(config, world: int = 1) -> dict:
    """Choose the threads for this process of a ``world``-rank run and set torch's intra-op threads
    to them; returns the choice (plus ``torch_default``, what torch would have used, and ``load``,
    the 1-minute load average at that moment) for the run's records. Called once, at device
    set-up, by apply and by the probe."""
    global _applied
    import torch

    choice = for_config(config, world_size=world)
    default = torch.get_num_threads()
    if choice["threads"] != default:
        torch.set_num_threads(choice["threads"])
    # the load of the moment, before our threads run: what the estimate's load terms compare
    _applied = {**choice, "torch_default": default, "load": load_average(),
                "omp_wait_policy": os.environ.get(WAIT_ENV) or "OpenMP default",
                "omp_wait_policy_from": (_wait or {}).get("source"), "load_at_import": (_wait or {}).get("load")}
    return dict(_applied)


def applied() -> dict | None:
    """The choice this process last applied (None before ``apply_thread_policy``)."""
    return None if _applied is None else dict(_applied)


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def contention(load: float | None, threads: int, cores: int) -> float:
    """How oversubscribed the cores are with ``threads`` of ours on top of ``load`` (other runnable
    processes, the 1-minute load average): 1.0 while they fit, (load + threads) / cores beyond."""
    return max(1.0, ((load or 0.0) + threads) / max(1, cores))


set_wait_policy()  # at import, before anything imports torch (see the module's docstring)
