"""What a training step returns (``StepResult``) and the error a non-finite step raises."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apr.errors import AprError


@dataclass
class StepResult:
    loss: torch.Tensor  # mean cross-entropy over the step's tokens (0-dim, on the device)
    grad_norm: torch.Tensor  # global gradient norm before clipping, unscaled (0-dim, on the device)
    skipped: bool = False  # fp16 overflow: no update this step, loss scale reduced
    flagged: bool = False  # the bad-step test (``step_gate``) said skip: no update, AdamW's count unchanged


class NonFiniteError(AprError):
    """The loss or the gradients are NaN/inf. ``state_is_last_good``: no parameter was updated
    with them, so the current weights are those before the first bad step and may be checkpointed.
    ``steps_back``: how many of the ``train_step`` calls so far are not in the weights (the first
    bad one and every one after it): 1 when raised by ``train_step`` itself, more when found by a
    later ``check_finite``."""

    def __init__(self, what: str, state_is_last_good: bool, steps_back: int = 1):
        super().__init__(f"non-finite {what}")
        self.what = what
        self.state_is_last_good = state_is_last_good
        self.steps_back = steps_back
