"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD, floored at min_lr.

Steps are counted from 1: ``lr_at(k)`` is the learning rate of the k-th optimizer update, the one
logged as step k. Warmup rises linearly to the peak at step ``warmup_steps``; the decay then ends
at exactly ``min_lr`` on the last step. Torch-free (the planner draws the curve from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("cosine", "linear", "constant", "wsd")


def lr_at(
    step: int,
    *,
    peak: float,
    min_lr: float,
    total_steps: int,
    warmup_steps: int,
    kind: str,
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate of optimizer update ``step`` (1-based) of ``total_steps``.

    - warmup (step <= warmup_steps): ``peak * (step / warmup_steps)``;
    - cosine: ``min + (peak - min) * (1 + cos(pi * p)) / 2`` with
      ``p = (step - warmup) / (total - warmup)``, so p = 1 on the last step;
    - linear: ``min + (peak - min) * (1 - p)``;
    - constant: ``peak`` (min_lr unused);
    - wsd (warmup-stable-decay): ``peak`` until the last ``D = round(decay_fraction * total)``
      steps (at least 1, at most total - warmup), then linear to ``min`` over those D steps.

    Each decay is written as ``min + (peak - min) * r`` with ``r`` exactly 0 on the last step, so
    the run ends at exactly ``min_lr`` (``peak - (peak - min)`` would round: 0.0999.. for 0.1).
    """
    kind = str(kind)
    if kind not in KINDS:
        raise ValueError(f"unknown lr_scheduler {kind!r}")
    if step < 1:
        raise ValueError("steps count from 1")
    if step <= warmup_steps:
        return peak * (step / warmup_steps)  # exactly peak at step == warmup_steps
    if kind == "constant":
        return peak
    step = min(step, total_steps)
    if kind == "wsd":
        decay_steps = min(max(1, round(decay_fraction * total_steps)), max(total_steps - warmup_steps, 1))
        decay_start = total_steps - decay_steps
        if step <= decay_start:
            return peak
        return min_lr + (peak - min_lr) * ((total_steps - step) / decay_steps)
    p = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
    if kind == "cosine":
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    return min_lr + (peak - min_lr) * (1.0 - p)


@dataclass(frozen=True)
class LRSchedule:
    peak: float
    min_lr: float
    total_steps: int
    warmup_steps: int
    kind: str
    decay_fraction: float = 0.2

    @classmethod
    def from_config(cls, config, total_steps: int, decay_start: int | None = None) -> LRSchedule:
        """From an ``AprConfig`` and the run's total steps (the plan's step algebra). ``decay_start``:
        the step a wsd decay starts at (``training.decay_stage``'s start), instead of decay_fraction."""
        opt, tr = config.optimizer, config.training
        fraction = tr.decay_fraction
        if decay_start is not None and total_steps > 0:
            fraction = (total_steps - decay_start) / total_steps
        return cls(opt.lr, opt.resolved_min_lr, total_steps, tr.warmup_steps, str(tr.lr_scheduler), fraction)

    def __call__(self, step: int) -> float:
        return lr_at(step, peak=self.peak, min_lr=self.min_lr, total_steps=self.total_steps,
                     warmup_steps=self.warmup_steps, kind=self.kind, decay_fraction=self.decay_fraction)
