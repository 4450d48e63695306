"""The plan's target: a catalogue GPU (apr/hardware.py), an explicit memory size, or this machine's
RAM for a CPU run; and whether ``device: auto`` would find a CUDA device here (torch-free).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from apr.config.numbers import parse_bytes
from apr.hardware import (  # noqa: F401  (re-exported: the plan's callers and tests name them here)
    ALIASES,
    CATALOGUE,
    DTYPES,
    Gpu,
    compute_dtype,
    from_device_name,
    known_names,
    lookup,
    mfu_basis,
)


@dataclass(frozen=True)
class Target:
    """What the plan budgets for: a catalogue GPU, an explicit VRAM size, or both (VRAM wins)."""

    name: str | None  # as the user wrote it
    gpu: Gpu | None
    vram_bytes: int | None
    source: str  # "--gpu", "--vram", "training.gpu", "training.vram", ...

    @property
    def known(self) -> bool:
        return self.name is None or self.gpu is not None

    def to_facts(self, precision: str) -> dict:
        facts: dict = {"known": self.known, "source": self.source, "catalogue": ", ".join(known_names())}
        if self.name is not None:
            facts["name"] = self.name
        if self.gpu is not None:
            facts["label"] = self.gpu.label
            peak = self.gpu.peak_flops(precision)
            if peak is not None:
                facts["peak_flops"] = peak
            facts["mfu"] = self.gpu.mfu
            facts["bf16"] = self.gpu.bf16
        if self.vram_bytes is not None:
            facts["vram_bytes"] = self.vram_bytes
        return facts

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "vram_bytes": self.vram_bytes,
                "gpu": asdict(self.gpu) if self.gpu else None}


class UnknownGpuError(ValueError):
    """A GPU name given on the command line is not in the catalogue (a usage error)."""


def host_memory_bytes() -> int | None:
    """This machine's physical memory (torch-free, no psutil): the budget of a CPU run."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_target(device: str = "cpu") -> Target | None:
    """The target of a plan for ``training.device: cpu`` (or ``auto`` on a machine without a CUDA
    device) with no GPU or VRAM given: this machine's RAM."""
    ram = host_memory_bytes()
    why = "training.device: cpu" if device == "cpu" else f"training.device: {device}, no CUDA device here"
    return None if not ram else Target(name=None, gpu=None, vram_bytes=ram, source=f"this machine's RAM, {why}")


def cuda_device_present() -> bool:
    """Whether ``device: auto`` would find a CUDA device here, judged without importing torch: the
    NVIDIA device files exist and CUDA_VISIBLE_DEVICES does not hide them all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return False
    try:
        return any(name[len("nvidia"):].isdigit() for name in os.listdir("/dev") if name.startswith("nvidia"))
    except OSError:
        return False


def local_gpu_name() -> str | None:
    """The first NVIDIA GPU's model as the driver names it ("NVIDIA H100 80GB HBM3"), torch-free
    (``/proc/driver/nvidia/gpus/*/information``); None without the driver's files."""
    root = "/proc/driver/nvidia/gpus"
    try:
        for bus in sorted(os.listdir(root)):
            with open(os.path.join(root, bus, "information")) as f:
                for line in f:
                    if line.startswith("Model:"):
                        return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
    return None


def resolve_target(
    gpu: str | None, vram: int | str | None, *, config_gpu: str | None = None, config_vram: int | None = None
) -> Target | None:
    """Combine command-line and config targets; the command line wins. None when nothing is given.

    An unknown name from the command line raises UnknownGpuError; one from the config gives a Target
    with ``known`` False, which contract C-MEM-003 reports with the key's line.
    """
    name, source = (gpu, "--gpu") if gpu else (config_gpu, "training.gpu") if config_gpu else (None, "")
    entry = lookup(name) if name else None
    if gpu and entry is None:
        raise UnknownGpuError(f"unknown GPU {gpu!r}; known: {', '.join(known_names())} (or use --vram 24GiB)")
    if vram is not None:
        vram_bytes, vsource = parse_bytes(vram), "--vram"
    elif config_vram is not None and not gpu:
        vram_bytes, vsource = config_vram, "training.vram"
    else:
        vram_bytes, vsource = (entry.vram_bytes if entry else None), source
    if name is None and vram_bytes is None:
        return None
    return Target(name=name, gpu=entry, vram_bytes=vram_bytes,
                  source=" + ".join(dict.fromkeys(s for s in (source, vsource) if s)))
