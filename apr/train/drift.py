"""Plan against actual (``monitoring.drift_after_steps``; docs/monitor.md, "Drift"): a ``StepHook``
that times the run's first steps and compares them with what its plan promised.

After ``after_steps`` steps of this process (the first 2 are a warm-up and not timed), the
measured tokens/s of the loop (steps, and whatever validation and checkpoints fell in between) is
compared with the plan's: a calibrated plan's measured tokens/s (apr/track/calibration.py), else
its time estimate (tokens / estimated seconds, per process). On CUDA the allocator's peak is
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

from apr.train.stop import StepReport, Stop

WARMUP = 2


def planned(plan_doc: dict | None, world_size: int) -> tuple[float | None, str]:
    """The plan's tokens/s per process, and where it comes from (or why there is none)."""
    facts = (plan_doc or {}).get("facts") or {}
    calibration = facts.get("calibration")
    if calibration and calibration.get("tokens_per_s"):
        return float(calibration["tokens_per_s"]), f"calibrated from {calibration.get('what', 'probes')}"
    seconds = (facts.get("time") or {}).get("estimated_seconds")
    tokens = (facts.get("steps") or {}).get("total_tokens")
    if seconds and tokens:
        return tokens / seconds / world_size, "the plan's time estimate"
    return None, "the plan has no time estimate (no catalogue GPU and no calibration)"


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
        plan_rate, source = planned(self.plan_doc, world)
        drift = {"step": report.step, "steps_timed": steps, "tokens_per_s": actual, "planned_tokens_per_s": plan_rate,
                 "planned_from": source, "drift_step_time": None, "drift_tokens_per_s": None, "drift_memory": None}
        if plan_rate:
            drift["drift_tokens_per_s"] = actual / plan_rate - 1.0
            drift["drift_step_time"] = plan_rate / actual - 1.0
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
        run.echo(f"{run._step_label(report.step)}  plan vs actual: {actual:,.0f} tokens/s"
                 + (" against " if plan_rate else "; ")
                 + (f"{plan_rate:,.0f} planned ({source})" if plan_rate else f"nothing planned: {source}")
                 + (f"; {shown}" if shown else ""))
        metrics = {k: drift[k] for k in ("drift_step_time", "drift_tokens_per_s", "drift_memory")
                   if drift[k] is not None}
        return run._check_alerts({**metrics, "step": report.step}, report.step, run.recorder) if metrics else None
