"""A catalogue of common training GPUs: memory, peak dense throughput and an assumed MFU.

Memory is what ``nvidia-smi`` reports as total (MiB); throughput is the vendor's dense (non-sparse)
peak. The MFU is an assumption for the time estimate, not a measurement: the reference reached
19.3% on a 4090 with its own kernels; well-tuned PyTorch trainers report 35-45% on A100/H100.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from apr.config.numbers import parse_bytes

_MIB = 2**20
_T = 10**12


@dataclass(frozen=True)
class Gpu:
    name: str  # catalogue key, e.g. "h100"
    label: str  # marketing name
    vram_bytes: int
    tflops_bf16: float  # dense tensor-core peak for bf16/fp16 with fp32 accumulation
    tflops_fp32: float  # plain fp32 (no TF32) peak
    mfu: float  # assumed model-FLOPs utilisation for the time estimate
    bf16: bool = True  # bfloat16 tensor cores (Ampere and newer); T4 and V100 only emulate bf16

    def peak_flops(self, precision: str) -> float:
        return (self.tflops_fp32 if precision == "fp32" else self.tflops_bf16) * _T


CATALOGUE: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("4090", "NVIDIA GeForce RTX 4090 24GB", 24564 * _MIB, 165.2, 82.6, 0.30),
        Gpu("3090", "NVIDIA GeForce RTX 3090 24GB", 24576 * _MIB, 71.0, 35.6, 0.30),
        Gpu("a10", "NVIDIA A10 24GB", 23028 * _MIB, 125.0, 31.2, 0.30),
        Gpu("l4", "NVIDIA L4 24GB", 23034 * _MIB, 121.0, 30.3, 0.30),
        Gpu("t4", "NVIDIA T4 16GB", 15360 * _MIB, 65.0, 8.1, 0.25, bf16=False),
        Gpu("v100", "NVIDIA V100 32GB", 32768 * _MIB, 125.0, 15.7, 0.30, bf16=False),
        Gpu("a6000", "NVIDIA RTX A6000 48GB", 49140 * _MIB, 154.8, 38.7, 0.30),
        Gpu("l40s", "NVIDIA L40S 48GB", 46068 * _MIB, 362.1, 91.6, 0.30),
        Gpu("a100-40gb", "NVIDIA A100 40GB", 40960 * _MIB, 312.0, 19.5, 0.40),
        Gpu("a100-80gb", "NVIDIA A100 80GB", 81920 * _MIB, 312.0, 19.5, 0.40),
        Gpu("h100", "NVIDIA H100 SXM 80GB", 81559 * _MIB, 989.4, 66.9, 0.35),
        Gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", 81559 * _MIB, 756.0, 51.2, 0.35),
        Gpu("h200", "NVIDIA H200 141GB", 143771 * _MIB, 989.4, 66.9, 0.35),
    )
}

ALIASES = {
    "rtx4090": "4090", "rtx-4090": "4090", "rtx3090": "3090", "rtx-3090": "3090",
    "a100": "a100-80gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb", "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb", "h100-sxm": "h100", "h100-80gb": "h100", "h200-141gb": "h200",
    "rtx-a6000": "a6000", "v100-32gb": "v100",
}


def lookup(name: str) -> Gpu | None:
    """The catalogue entry for ``name`` (case-insensitive, a few aliases), or None."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    return CATALOGUE.get(key)


def known_names() -> list[str]:
    return list(CATALOGUE)


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
            facts["peak_flops"] = self.gpu.peak_flops(precision)
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
