"""The memory an execution policy must fit in at apply time when the plan names no target: the
CUDA device's total memory, or on the CPU the memory the machine has available."""

from __future__ import annotations

import os

import torch

from apr.train.engine import resolve_device


def device_budget(config) -> tuple[int, str] | None:
    """``(bytes, source)`` for the device ``training.device`` resolves to; None when unknown."""
    device = resolve_device(str(config.training.device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name} (the device at apply)"
    available = _meminfo_available()
    if available is not None:
        return available, "available RAM (the CPU at apply)"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM (the CPU at apply)"
    except (ValueError, OSError, AttributeError):
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
