"""Compute precision: fp32, bf16 autocast, fp16 autocast with dynamic loss scaling.

Master weights, gradients and AdamW state are float32, or bf16 with ``training.state_dtype: bf16``
(mixed_precision bf16 only: the stored weights are then the compute weights; validate refuses the
rest, apr/plan/statefacts.py); autocast runs the matmuls in the compute dtype and the residual
stream (the blocks' inputs and outputs) is kept in it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from apr.memory.buffers import compute_dtype_name
from apr.model.spec import DTYPE_BYTES


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of ``training.mixed_precision`` (bf16 -> torch.bfloat16) or of a buffer-plan
    dtype name (``apr.model.spec.DTYPE_BYTES``: float32, bfloat16, int64, ...)."""
    name = str(precision)
    return getattr(torch, name if name in DTYPE_BYTES else compute_dtype_name(name))


def autocast(device: torch.device, dtype: torch.dtype):
    """An autocast context for ``dtype`` on ``device`` (a no-op context for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class DynamicLossScaler:
    """fp16 loss scaling with torch.amp.GradScaler's policy: multiply the loss by ``scale``; on an
    overflowing gradient skip the step and halve the scale; after ``growth_interval`` good steps in
    a row double it. Gradients are unscaled inside the optimizer step (``grad_scale = 1/scale``)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise FloatingPointError(f"loss scale left the representable range: {self.scale}")

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
