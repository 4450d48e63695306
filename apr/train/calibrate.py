"""A finished run calibrates the plan: its measured throughput (tokens over the training loop's wall
time: steps, validation, checkpoints, records) and its actual seconds beside what its plan
estimated go to the global registry's calibration store (apr/track/calibration.py; docs/plan.md,
"Probe"), so the next plan of the same shape on the same device estimates its time from what runs
really did: their tokens/s, or a probe's corrected by their actual / estimated ratio.

Compiling (``training.execution.compile``) is kept out of the step time and the start-up: what
torch's compiler spent in this process (its compile metrics: block 0 at engine build, the graphs
the loop compiles lazily) is subtracted from each and recorded as its own term, with whether
inductor's cache was cold or warm (issue 54 item 8). A cold run's 30 s of compiling counted as
start-up or step time made the next, warm run's estimate several times too long."""

from __future__ import annotations

import os
import platform
import time

import torch

from apr import STARTED_AT, __version__, threads
from apr.track import calibration

MIN_STEPS = 10  # fewer steps say more about start-up than about throughput


def estimate_vs_actual(plan_doc: dict | None, actual_seconds: float, steps: int) -> dict:
    """What the run's plan estimated (point, range, the uncorrected base) beside the actual wall
    time; the base is scaled to the steps run when they differ from the plan's."""
    time_facts = ((plan_doc or {}).get("facts") or {}).get("time") or {}
    planned_steps = (((plan_doc or {}).get("facts") or {}).get("steps") or {}).get("total_steps")
    out: dict = {"actual_seconds": actual_seconds}
    if not time_facts.get("estimated_seconds"):
        return out
    scale = steps / planned_steps if planned_steps and steps != planned_steps else 1.0
    startup = time_facts.get("startup_seconds") or 0.0
    compiling = time_facts.get("compile_seconds") or 0.0  # a fixed term, as start-up is; not in the base

    def scaled(seconds, fixed=startup + compiling):
        return None if seconds is None else fixed + (seconds - fixed) * scale

    out.update(estimated_seconds=scaled(time_facts["estimated_seconds"]),
               low_seconds=scaled(time_facts.get("low_seconds")), high_seconds=scaled(time_facts.get("high_seconds")))
    if time_facts.get("calibrated") and time_facts.get("base_seconds"):
        out.update(base_seconds=scaled(time_facts["base_seconds"], startup), base_kind=time_facts.get("base_kind"),
                   plan_assumes=time_facts.get("assumes") or {})
    if out["low_seconds"] is not None and out["high_seconds"] is not None:
        out["inside_range"] = out["low_seconds"] <= actual_seconds <= out["high_seconds"]
    out["actual_over_estimate"] = actual_seconds / out["estimated_seconds"]
    return out


def compile_seconds(since: float | None = None, only_after: bool = False) -> dict:
    """What torch's compiler (dynamo, AOT autograd, inductor) spent in this process, from its
    compilation metrics: ``seconds`` in all, ``before`` and ``after`` the epoch time ``since``
    (the loop's start), and ``cache``: ``cold`` when inductor missed its FX-graph cache at least
    once, ``warm`` when it only hit it, None when nothing was compiled. ``only_after``: compiles
    that began before ``since`` are none of the caller's (an earlier probe in this process)."""
    out = {"seconds": 0.0, "before": 0.0, "after": 0.0, "cache": None}
    try:
        from torch._dynamo import utils as dynamo_utils  # lazy: dynamo loads in seconds; a finished run's summary only

        metrics = list(dynamo_utils.get_compilation_metrics())
    except Exception:  # a torch without them: nothing known, nothing subtracted
        return out
    hits = misses = 0
    for m in metrics:
        duration = getattr(m, "duration_us", None)
        seconds = duration / 1e6 if duration else (getattr(m, "entire_frame_compile_time_s", None) or 0.0)
        start = getattr(m, "start_time", None)
        if start is None and getattr(m, "start_time_us", None):
            start = m.start_time_us / 1e6
        after = since is not None and start is not None and start >= since
        if only_after and not after:
            continue
        out["seconds"] += seconds
        out["after" if after else "before"] += seconds
        hits += getattr(m, "inductor_fx_local_cache_hit_count", None) or 0
        misses += getattr(m, "inductor_fx_local_cache_miss_count", None) or 0
    if out["seconds"] > 0:
        out["cache"] = "cold" if misses else ("warm" if hits else None)
    return out


def _load_factor(result: dict) -> float | None:
    """How much busier the cores were during the run than when its plan's probe measured: the
    contention of the mean of the other load at the start and at the end (the load average then
    counts our own threads too) over the probe's. The calibration divides a run's actual /
    estimated by it, so a correction learns the loop's overhead, not that day's load."""
    assumes = result.get("plan_assumes") or {}
    start, end, probe_load = result.get("load"), result.get("load_at_end"), assumes.get("load_at_calibration")
    cores, n = assumes.get("cores"), result.get("threads")
    if None in (start, end, probe_load, cores, n) or result.get("device") != "cpu":
        return None
    others = (start + max(0.0, end - n)) / 2
    return threads.contention(others, n, cores) / threads.contention(probe_load, n, cores)


def record_run(run, seconds: float, steps: int, apr_home=None, loop_started_at: float | None = None) -> None:
    """Record a fresh, finished run of ``steps`` steps in ``seconds``; quietly nothing on failure
    (a read-only registry is already a warning of the recorder's)."""
    if steps < MIN_STEPS or seconds <= 0:
        return
    device = run.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else calibration.host_cpu_name()
    tokens = steps * run.tokens_per_step
    world = 1 if run.dp is None else run.dp.world_size
    # from the process's first import of apr to the first step: imports, plan, data, engine; what
    # compiling took (before the loop: block 0 at engine build; in it: graphs compiled lazily) is
    # its own term, never start-up or step time
    startup = (loop_started_at or time.time()) - STARTED_AT
    compiled = compile_seconds(loop_started_at)
    actual = startup + seconds
    seconds = max(seconds - compiled["after"], seconds * 0.05)
    startup = max(0.0, startup - compiled["before"])
    choice = threads.applied() or {}
    result = {"source": "run", "run_id": run.run_id, "device": device.type, "device_name": name,
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "apr": __version__,
                           "python": platform.python_version()},
              "steps": steps, "seconds": seconds, "step_seconds": seconds / steps, "startup_seconds": startup,
              "tokens_per_s": tokens / seconds / world, "rows": [],
              "threads": torch.get_num_threads(), "load": choice.get("load"), "load_at_end": threads.load_average(),
              **estimate_vs_actual(getattr(run, "plan_doc", None), actual, steps)}
    if compiled["seconds"] > 0:
        result.update(compile_seconds=compiled["seconds"], compile_cache=compiled["cache"],
                      compile_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    result["load_factor"] = _load_factor(result)
    cpu_threads = result["threads"] if device.type == "cpu" else None
    try:
        calibration.record(result, calibration.shape(run.config, run.engine.execution.to_dict(), cpu_threads),
                           apr_home)
    except Exception:
        pass
    if result.get("estimated_seconds"):
        low, high = result.get("low_seconds"), result.get("high_seconds")
        run.echo(f"time: {result['actual_seconds']:.1f} s against ~{result['estimated_seconds']:.1f} s planned"
                 + (f" ({low:.1f}-{high:.1f} s: {'inside' if result['inside_range'] else 'OUTSIDE'} the range)"
                    if low is not None and high is not None else "")
                 + (f"; load {result['load_at_end']:.1f}" if result["load_at_end"] is not None else ""))
