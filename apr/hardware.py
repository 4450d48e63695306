"""The GPU catalogue: memory, the dense peak FLOP/s per dtype with the vendor document each comes
from, and an assumed MFU; and the peak a run's MFU is quoted against, or why there is none.

Torch-free and dependency-free, low in the layers: the plan (apr/plan/gpus.py: targets, the time
estimate) and the run loop (apr/train/steplog.py: measured MFU/HFU) read the same table.

Memory is what ``nvidia-smi`` reports as total (MiB). Throughput is the vendor's dense (non-sparse)
tensor-core peak per dtype, from the datasheet or architecture whitepaper named in ``source``
(docs/plan.md, "GPU catalogue", cites each); a dtype the card has no peak for (bf16 on a T4 or V100,
TF32 before Ampere) is absent, and MFU for it is unknown, never a neighbour's number. The MFU is
an assumption for the time estimate, not a measurement: the reference reached 19.3% on a 4090 with
its own kernels; well-tuned PyTorch trainers report 35-45% on A100/H100.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MIB = 2**20
_T = 10**12

DTYPES = ("bf16", "fp16", "tf32", "fp32")  # the peak table's columns


def compute_dtype(precision: str) -> str:
    """The dtype whose peak a run of ``training.mixed_precision`` is measured against: bf16/fp16 run
    their matmuls in that dtype; fp32 runs plain fp32 (apr never enables TF32)."""
    return str(precision)


@dataclass(frozen=True)
class Gpu:
    name: str  # catalogue key, e.g. "h100"
    label: str  # marketing name
    vram_bytes: int
    tflops: tuple[tuple[str, float], ...]  # (dtype, dense peak TFLOP/s); fp16/bf16 with fp32 accumulation
    mfu: float  # assumed model-FLOPs utilisation for the time estimate
    source: str  # the vendor document the peaks come from
    device_names: str = ""  # regex over torch.cuda.get_device_name() that means this card

    @property
    def bf16(self) -> bool:
        """bfloat16 tensor cores (Ampere and newer); T4 and V100 only emulate bf16."""
        return self.peak_tflops("bf16") is not None

    def peak_tflops(self, dtype: str) -> float | None:
        return dict(self.tflops).get(dtype)

    def peak_flops(self, precision: str) -> float | None:
        """Dense peak FLOP/s for a run of ``precision``; None when the table has no peak for it."""
        tf = self.peak_tflops(compute_dtype(precision))
        return None if tf is None else tf * _T


def _g(name, label, mib, bf16, fp16, tf32, fp32, mfu, source, device_names):
    peaks = tuple((d, v) for d, v in zip(DTYPES, (bf16, fp16, tf32, fp32), strict=True) if v is not None)
    return Gpu(name, label, mib * _MIB, peaks, mfu, source, device_names)


_ADA = "NVIDIA Ada GPU Architecture whitepaper (v2.1), appendix table 'GeForce RTX 4090'"
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper (v2.0), appendix tables"
CATALOGUE: dict[str, Gpu] = {
    g.name: g
    for g in (
        _g("4090", "NVIDIA GeForce RTX 4090 24GB", 24564, 165.2, 165.2, 82.6, 82.6, 0.30, _ADA,
           r"rtx 4090$"),
        _g("3090", "NVIDIA GeForce RTX 3090 24GB", 24576, 71.0, 71.0, 35.6, 35.6, 0.30, _GA102 + " (RTX 3090)",
           r"rtx 3090$"),
        _g("a10", "NVIDIA A10 24GB", 23028, 125.0, 125.0, 62.5, 31.2, 0.30, "NVIDIA A10 Tensor Core GPU datasheet",
           r"\ba10\b(?!0)"),
        _g("l4", "NVIDIA L4 24GB", 23034, 121.0, 121.0, 60.0, 30.3, 0.30,
           "NVIDIA L4 Tensor Core GPU datasheet (sparse figures halved)", r"\bl4\b"),
        _g("t4", "NVIDIA T4 16GB", 15360, None, 65.0, None, 8.1, 0.25, "NVIDIA T4 Tensor Core GPU datasheet",
           r"\bt4\b"),
        _g("v100", "NVIDIA V100 32GB", 32768, None, 125.0, None, 15.7, 0.30,
           "NVIDIA V100 Tensor Core GPU datasheet (SXM2)", r"\bv100\b.*\bsxm2\b"),
        _g("a6000", "NVIDIA RTX A6000 48GB", 49140, 154.8, 154.8, 77.4, 38.7, 0.30, _GA102 + " (RTX A6000)",
           r"rtx a6000$"),
        _g("l40s", "NVIDIA L40S 48GB", 46068, 362.1, 362.1, 183.0, 91.6, 0.30,
           "NVIDIA L40S GPU datasheet (sparse figures halved)", r"\bl40s\b"),
        _g("a100-40gb", "NVIDIA A100 40GB", 40960, 312.0, 312.0, 156.0, 19.5, 0.40,
           "NVIDIA A100 Tensor Core GPU datasheet", r"\ba100\b.*\b40\s?gb\b"),
        _g("a100-80gb", "NVIDIA A100 80GB", 81920, 312.0, 312.0, 156.0, 19.5, 0.40,
           "NVIDIA A100 Tensor Core GPU datasheet", r"\ba100\b.*\b80\s?gb\b"),
        _g("h100", "NVIDIA H100 SXM 80GB", 81559, 989.4, 989.4, 494.7, 66.9, 0.35,
           "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (sparse figures halved)",
           r"\bh100\b(?!.*\b(pcie|nvl)\b).*\b(sxm\d*|hbm3)\b"),
        _g("h100-pcie", "NVIDIA H100 PCIe 80GB", 81559, 756.0, 756.0, 378.0, 51.2, 0.35,
           "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column (sparse figures halved)", r"\bh100\b.*\bpcie\b"),
        _g("h200", "NVIDIA H200 141GB", 143771, 989.4, 989.4, 494.7, 66.9, 0.35,
           "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (sparse figures halved)",
           r"\bh200\b(?!.*\bnvl\b)"),
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


def from_device_name(device_name: str) -> Gpu | None:
    """The catalogue entry of a CUDA device as torch names it ("NVIDIA H100 80GB HBM3", "NVIDIA
    A100-SXM4-80GB"), or None: a card not in the catalogue has no peak, so no MFU."""
    text = re.sub(r"[-_]", " ", device_name.lower())
    found = [g for g in CATALOGUE.values() if g.device_names and re.search(g.device_names, text)]
    return found[0] if len(found) == 1 else None


def mfu_basis(gpu: Gpu | None, precision: str, name: str | None = None) -> dict:
    """The peak a run's MFU is quoted against, or why there is none: ``{"known": True, "dtype",
    "peak_flops", "source"}`` or ``{"known": False, "dtype", "reason"}``. Never a fallback number."""
    dtype = compute_dtype(precision)
    if gpu is None:
        what = f"GPU {name!r} is not in the peak-FLOPs table" if name else "no GPU is named (--gpu or training.gpu)"
        return {"known": False, "dtype": dtype, "reason": f"{what}; known: {', '.join(known_names())}"}
    peak = gpu.peak_flops(precision)
    if peak is None:
        have = ", ".join(d for d, _ in gpu.tflops)
        return {"known": False, "dtype": dtype,
                "reason": f"{gpu.label} has no {dtype} peak in the table (it has {have})"}
    return {"known": True, "dtype": dtype, "peak_flops": peak, "source": gpu.source}


