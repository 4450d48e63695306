"""A finished run calibrates the plan: its measured throughput (tokens over the training loop's wall
time: steps, validation, checkpoints, records) goes to the global registry's calibration store
(apr/track/calibration.py; docs/plan.md, "Probe"), so the next plan of the same shape on the same
device estimates its time from what runs really did."""

from __future__ import annotations

import platform
import time

import torch

from apr import STARTED_AT, __version__
from apr.track import calibration

MIN_STEPS = 10  # fewer steps say more about start-up than about throughput


def record_run(run, seconds: float, steps: int, apr_home=None, loop_started_at: float | None = None) -> None:
    """Record a fresh, finished run of ``steps`` steps in ``seconds``; quietly nothing on failure
    (a read-only registry is already a warning of the recorder's)."""
    if steps < MIN_STEPS or seconds <= 0:
        return
    device = run.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else calibration.host_cpu_name()
    tokens = steps * run.tokens_per_step
    world = 1 if run.dp is None else run.dp.world_size
    result = {"source": "run", "run_id": run.run_id, "device": device.type, "device_name": name,
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "apr": __version__,
                           "python": platform.python_version()},
              "steps": steps, "seconds": seconds, "step_seconds": seconds / steps,
              # from the process's first import of apr to the first step: imports, plan, data, engine
              "startup_seconds": (loop_started_at or time.time()) - STARTED_AT,
              "tokens_per_s": tokens / seconds / world, "rows": []}
    try:
        calibration.record(result, calibration.shape(run.config, run.engine.execution.to_dict()), apr_home)
    except Exception:
        pass
