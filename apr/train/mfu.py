"""Measured MFU and HFU of a run on a catalogue GPU: the logged throughput against the peak of the
GPU's dtype in apr/hardware.py. A device the table does not name (a CPU, an H100 NVL, an A10G) has
no MFU: apply says so once and records none, never a neighbour's peak (docs/plan.md, "MFU and HFU").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apr.config.schema import AprConfig
from apr.hardware import from_device_name, mfu_basis
from apr.model.spec import flops_per_token
from apr.steps.execution import Execution, step_cost_f


@dataclass(frozen=True)
class MfuMeter:
    """``tokens_per_s -> {"mfu", "hfu"}``: tokens/s (all ranks) x model FLOPs per token over the peak
    of every GPU; HFU adds the execution's recompute (``cost_f / 3``)."""

    flops_per_token: int  # model FLOPs: 6N + attention (apr.model.spec.flops_per_token)
    hfu_per_mfu: float  # the execution policy's forward-equivalents per step / 3
    peak_flops: float  # the dtype's dense peak x the GPUs

    def __call__(self, tokens_per_s: float | None) -> dict:
        if not tokens_per_s:
            return {}
        mfu = tokens_per_s * self.flops_per_token / self.peak_flops
        return {"mfu": mfu, "hfu": mfu * self.hfu_per_mfu}


def mfu_meter(config: AprConfig, device: torch.device, execution: Execution,
              world_size: int) -> tuple[MfuMeter | None, str]:
    """The meter for this run and the line apply prints about it; None and the reason MFU is unknown."""
    precision = str(config.training.mixed_precision)
    if device.type != "cuda":
        return None, f"MFU unknown: the device is {device.type}; the peak table (apr/hardware.py) lists GPUs only"
    name = torch.cuda.get_device_name(device)
    gpu = from_device_name(name)
    basis = mfu_basis(gpu, precision, name)
    if gpu is None or not basis["known"]:
        return None, f"MFU unknown: {basis['reason']}"
    meter = MfuMeter(flops_per_token(config.model.architecture, config.data.seq_len),
                     step_cost_f(config, execution) / 3.0, basis["peak_flops"] * world_size)
    return meter, (f"MFU against {gpu.label} ({name}): {basis['peak_flops'] / 1e12:,.1f} TFLOP/s {basis['dtype']} "
                   f"dense x {world_size} GPU{'s' if world_size != 1 else ''} ({basis['source']})")
