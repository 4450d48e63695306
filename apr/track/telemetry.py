"""GPU telemetry through NVML (`pynvml`, from the optional `nvidia-ml-py`); None where unavailable.

`gpu_snapshot()` never raises: no package, no driver or no device all mean None, and the run's
`training_state.json` then carries `"gpu": null`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_lock = threading.Lock()
_nvml: dict[str, Any] = {"module": None, "failed": False}


def _init():
    """The initialised pynvml module, or None (remembered, so a box without NVML pays once)."""
    with _lock:
        if _nvml["module"] is not None or _nvml["failed"]:
            return _nvml["module"]
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            _nvml["failed"] = True
            return None
        _nvml["module"] = pynvml
        return pynvml


def default_device_index() -> int:
    """The NVML index of this process's GPU: LOCAL_RANK under torchrun, else 0.

    NVML numbers devices physically; with CUDA_VISIBLE_DEVICES set, the visible list maps it.
    """
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local < len(ids) and ids[local].isdigit():
            return int(ids[local])
    return local


def gpu_snapshot(index: int | None = None) -> dict | None:
    """``{name, utilization, memory_used, memory_total, temperature, power_w}`` for one GPU.

    utilization: percent busy over NVML's last sample period; memory_*: bytes; temperature:
    degrees C; power_w: watts. A field NVML cannot read is None. No GPU or no NVML: None.
    """
    nvml = _init()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(default_device_index() if index is None else index)
    except Exception:
        return None

    def read(fn, *args):
        try:
            return fn(handle, *args)
        except Exception:
            return None

    name = read(nvml.nvmlDeviceGetName)
    if isinstance(name, bytes):
        name = name.decode("utf-8", "replace")
    util = read(nvml.nvmlDeviceGetUtilizationRates)
    mem = read(nvml.nvmlDeviceGetMemoryInfo)
    temp = read(nvml.nvmlDeviceGetTemperature, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
    power_mw = read(nvml.nvmlDeviceGetPowerUsage)
    return {
        "name": name,
        "utilization": getattr(util, "gpu", None),
        "memory_used": getattr(mem, "used", None),
        "memory_total": getattr(mem, "total", None),
        "temperature": temp,
        "power_w": None if power_mw is None else power_mw / 1000.0,
    }
