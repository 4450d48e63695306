"""Plan against actual (``monitoring.drift_after_steps``; docs/monitor.md, "Drift"): a ``StepHook``
that times the run's first steps and compares them with what its plan promised.

After ``after_steps`` steps of this process (the first 2 are a warm-up and not timed), the
measured tokens/s of the loop (steps, and whatever validation and checkpoints fell in between) is
compared with the plan's: a calibrated plan's range of loop tokens/s (apr/plan/facts.py,
``calibrated_estimate``), else its time estimate (tokens / estimated seconds, per process). Inside
the range the step-time drift is 0: the plan said it could be that slow; beyond it, the drift
counts from the range's edge, so a loaded machine the range allowed for raises nothing. On the
CPU, cores busier now than at plan time (load average, the plan's threads and cores) move the
slow edge by the contention's change, and the record says so (``load_explains``). On CUDA the allocator's peak is
compared with the plan's memory total per GPU; on the CPU there is no allocator peak, so memory
drift is unknown. Each figure is a fraction: ``drift_step_time`` 0.3 = steps 30% slower than
planned, ``drift_tokens_per_s`` -0.23 = 23% fewer tokens/s, ``drift_memory`` 0.1 = 10% more memory.
They are recorded once (``drift`` in training_state.json, ``drift_*`` metric rows) and handed to
the alert conditions at that step, so ``drift_step_time > 0.3`` can warn and ``drift_memory > 0``
can stop.
"""

from __future__ import annotations

import time

import torch

from apr.threads import applied, load_average
from apr.train.stop import StepReport, Stop

WARMUP = 2


def planned(plan_doc: dict | None, world_size: int) -> tuple[float | None, str]:
    """The plan's tokens/s per process, and where it comes from (or why there is none)."""
    rate = planned_range(plan_doc, world_size)
    return rate["tokens_per_s"], rate["source"]


def planned_range(plan_doc: dict | None, world_size: int) -> dict:
    """The plan's loop tokens/s per process as a point and a range (``low``, ``high``; equal to the
    point when the plan has no range), where it comes from, and the load and threads it assumed."""
    facts = (plan_doc or {}).get("facts") or {}
    time_facts, calibration = facts.get("time") or {}, facts.get("calibration")
    if time_facts.get("calibrated") and time_facts.get("loop_tokens_per_s"):
        rate = float(time_facts["loop_tokens_per_s"])
        return {"tokens_per_s": rate, "low": float(time_facts.get("tokens_per_s_low") or rate),
                "high": float(time_facts.get("tokens_per_s_high") or rate),
                "source": f"calibrated from {(calibration or {}).get('what', 'probes')}",
                "assumes": time_facts.get("assumes") or {}}
    if calibration and calibration.get("tokens_per_s"):  # a plan file from before the range
        rate = float(calibration["tokens_per_s"])
        return {"tokens_per_s": rate, "low": rate, "high": rate, "assumes": {},
                "source": f"calibrated from {calibration.get('what', 'probes')}"}
    seconds = time_facts.get("estimated_seconds")
    tokens = (facts.get("steps") or {}).get("total_tokens")
    if seconds and tokens:
        rate = tokens / seconds / world_size
        return {"tokens_per_s": rate, "low": rate, "high": rate, "assumes": {}, "source": "the plan's time estimate"}
    return {"tokens_per_s": None, "low": None, "high": None, "assumes": {},
            "source": "the plan has no time estimate (no catalogue GPU and no calibration)"}


def compare(actual: float, plan: dict, load_now: float | None) -> dict:
    """The drift of ``actual`` loop tokens/s from the plan's range: 0 inside it; beyond an edge, the
    fraction past that edge (``drift_step_time`` 0.5 = steps 50% slower than the range's slow end).
    A CPU run whose cores are busier now than when the plan was calibrated has that slow end moved
    by the contention's change (load noise), and says so; ``*_point`` is the drift from the point."""
    low, high, point = plan["low"], plan["high"], plan["tokens_per_s"]
    assumes = plan.get("assumes") or {}
    out = {"planned_low_tokens_per_s": low, "planned_high_tokens_per_s": high, "load_now": load_now,
           "load_at_plan": assumes.get("load_now"), "threads": assumes.get("threads"), "load_explains": None}
    if not point:
        return {**out, "drift_step_time": None, "drift_tokens_per_s": None, "drift_step_time_point": None}
    if assumes.get("cores") and load_now is not None and assumes.get("load_now") is not None:
        others = max(0.0, load_now - assumes["threads"])  # the load average counts our own threads now
        busier = (max(1.0, (others + assumes["threads"]) / assumes["cores"])
                  / max(1.0, (assumes["load_now"] + assumes["threads"]) / assumes["cores"]))
        if busier > 1.0:
            out["load_explains"] = busier
            low = low / busier
    out["drift_step_time_point"] = point / actual - 1.0
    if actual < low:
        out.update(drift_step_time=low / actual - 1.0, drift_tokens_per_s=actual / low - 1.0)
    elif actual > high:
        out.update(drift_step_time=high / actual - 1.0, drift_tokens_per_s=actual / high - 1.0)
    else:
        out.update(drift_step_time=0.0, drift_tokens_per_s=0.0)
    return out


class DriftCheck:
    def __init__(self, plan_doc: dict | None, after_steps: int):
        self.plan_doc, self.after_steps = plan_doc, int(after_steps)
        self._t0: float | None = None
        self.result: dict | None = None

    def after_step(self, run, report: StepReport) -> Stop | None:
        done = report.step - run.start_step
        if done == WARMUP:
            self._t0 = time.perf_counter()
            if run.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(run.device)
        if done != self.after_steps or self._t0 is None or self.result is not None:
            return None
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        seconds = time.perf_counter() - self._t0
        steps = self.after_steps - WARMUP
        actual = steps * run.tokens_per_step / seconds / (1 if run.dp is None else run.dp.world_size)
        world = 1 if run.dp is None else run.dp.world_size
        plan = planned_range(self.plan_doc, world)
        plan_rate, source = plan["tokens_per_s"], plan["source"]
        drift = {"step": report.step, "steps_timed": steps, "tokens_per_s": actual, "planned_tokens_per_s": plan_rate,
                 "planned_from": source, "drift_memory": None,
                 **compare(actual, plan, load_average() if run.device.type == "cpu" else None),
                 "thread_choice": applied()}  # the threads this process runs (apr/threads.py), in the run's record
        planned_bytes = ((self.plan_doc or {}).get("memory") or {}).get("total_bytes")
        if run.device.type == "cuda" and planned_bytes:
            peak = torch.cuda.max_memory_allocated(run.device)
            drift.update(peak_bytes=peak, planned_bytes=planned_bytes, drift_memory=peak / planned_bytes - 1.0)
        else:
            drift["memory_unknown"] = ("no allocator peak on the CPU" if run.device.type != "cuda"
                                       else "the plan has no memory total")
        self.result = drift
        run.recorder.log_drift(report.step, drift)
        shown = ", ".join(f"{k} {drift[k]:+.1%}" for k in ("drift_step_time", "drift_tokens_per_s", "drift_memory")
                          if drift[k] is not None)
        planned_text = f"{plan_rate:,.0f} planned" if plan_rate else ""
        if plan_rate and drift["planned_low_tokens_per_s"] != drift["planned_high_tokens_per_s"]:
            planned_text += (f" ({drift['planned_low_tokens_per_s']:,.0f}-{drift['planned_high_tokens_per_s']:,.0f};"
                             " drift counts from the range's edge)")
        load_text = (f"; load {drift['load_now']:.1f} now vs {drift['load_at_plan']:.1f} planned, slow edge x "
                     f"1/{drift['load_explains']:.2f}" if drift.get("load_explains") else "")
        run.echo(f"{run.step_label(report.step)}  plan vs actual: {actual:,.0f} tokens/s"
                 + (" against " if plan_rate else "; ")
                 + (f"{planned_text} ({source})" if plan_rate else f"nothing planned: {source}")
                 + (f"; {shown}" if shown else "") + load_text)
        metrics = {k: drift[k] for k in ("drift_step_time", "drift_tokens_per_s", "drift_memory")
                   if drift[k] is not None}
        return run.check_alerts({**metrics, "step": report.step}, report.step, run.recorder) if metrics else None
