"""NF4 storage of frozen weights (4-bit NormalFloat with double-quantized scalers, Dettmers et al.
2023) through torchao: the stacking trunk's ``nf4`` precision (``apr.model.trunk``) and a QLoRA
base (``model.lora.trunk_dtype: nf4``, ``apr.model.lora``). torchao is imported only here, when a
weight is quantized: it is the ``quant`` extra, not a core dependency."""

from __future__ import annotations

import logging

import torch

from apr.model import spec


def _nf4():
    """torchao's NF4 (``to_nf4``, ``NF4Tensor``), imported with its loader's warnings silenced: the
    wheel's CUDA extensions (MX, CUTLASS) fail to load on a CPU-only torch, which NF4 never uses."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.quantization import to_nf4  # lazy: torchao imports in seconds, NF4 weights only
        from torchao.quantization.quantize_.workflows import NF4Tensor
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return to_nf4, NF4Tensor


def to_nf4(weight: torch.Tensor):
    """``weight`` (float32) as an NF4Tensor in apr's block sizes (``spec.nf4_scaler_block``). A
    function of the float32 values: the same weight always gets the same codes (quantizing a
    dequantized weight is not idempotent, so only float32 sources are quantized)."""
    quantize, _ = _nf4()
    return quantize(weight.detach().float().contiguous(), spec.NF4_BLOCK, spec.nf4_scaler_block(weight.numel()))


def is_nf4(weight: torch.Tensor) -> bool:
    return type(weight).__name__ == "NF4Tensor"


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A stored weight as float32 (NF4 dequantized, half precision widened exactly)."""
    return (weight.get_original_weight() if is_nf4(weight) else weight.detach()).float().contiguous()
