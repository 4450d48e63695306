"""Bad-step skipping (``training.bad_steps``; docs/design.md, "Surviving spikes"): a z-score test of
a step's loss and gradient norm against EMAs of their mean and variance over the steps not skipped.

The engine asks ``BadStepTest.verdict`` once both figures it needs are known and before the first
AdamW update of the step (apr/train/engine.py ``step_gate``); a flagged step applies no update and
is not counted by AdamW's step counter, so the next step continues as if the batch had never been
drawn (only the LR schedule's step moves on). Only upward outliers are flagged: a loss far *below*
its history is not a reason to throw a step away. The statistics travel in checkpoints
(``state_dict``), so a resumed run tests against the same history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class RunningStats:
    """Mean and variance as EMAs with span ``window`` (alpha = 2 / (window + 1)); the first
    observation starts them (variance 0)."""

    def __init__(self, window: int):
        self.alpha = 2.0 / (window + 1.0)
        self.count = 0
        self.mean = 0.0
        self.var = 0.0

    def z(self, x: float) -> float:
        """How many standard deviations ``x`` is above the mean (inf above a zero-variance history)."""
        if self.count == 0:
            return 0.0
        sd = math.sqrt(self.var)
        if sd == 0.0:
            return 0.0 if x <= self.mean else math.inf
        return (x - self.mean) / sd

    def add(self, x: float) -> None:
        if self.count == 0:
            self.mean, self.var = x, 0.0
        else:  # West's incremental EMA of mean and variance
            diff = x - self.mean
            incr = self.alpha * diff
            self.mean += incr
            self.var = (1.0 - self.alpha) * (self.var + diff * incr)
        self.count += 1

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.var = int(state["count"]), float(state["mean"]), float(state["var"])


@dataclass(frozen=True)
class Verdict:
    """Why a step was skipped, with its figures (recorded as a ``bad_step`` event)."""

    what: str  # "loss" | "grad_norm"
    value: float
    z: float
    mean: float
    sd: float
    loss: float
    grad_norm: float | None

    def message(self) -> str:
        return (f"skipped: {self.what} {self.value:.4g} is {self.z:.1f} sd above its running mean "
                f"{self.mean:.4g} (sd {self.sd:.3g}); no update")

    def to_dict(self) -> dict:
        return {"what": self.what, "value": self.value, "z": self.z, "mean": self.mean, "sd": self.sd,
                "loss": self.loss, "grad_norm": self.grad_norm}


class BadStepTest:
    def __init__(self, loss_z: float | None, grad_norm_z: float | None, window: int, min_history: int):
        self.loss_z, self.grad_norm_z, self.min_history = loss_z, grad_norm_z, int(min_history)
        self.loss = RunningStats(window)
        self.grad_norm = RunningStats(window)

    @classmethod
    def of(cls, bs) -> BadStepTest | None:
        """From ``training.bad_steps``; None when neither test is on."""
        if bs.loss_z is None and bs.grad_norm_z is None:
            return None
        return cls(bs.loss_z, bs.grad_norm_z, bs.window, bs.min_history)

    @property
    def needs_norm(self) -> bool:
        return self.grad_norm_z is not None

    def verdict(self, loss: float, grad_norm: float | None) -> Verdict | None:
        """The reason to skip this step, or None (and then the step's figures join the history).
        A non-finite figure is not judged here: the engine's non-finite handling owns it."""
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            return None
        if self.loss.count >= self.min_history:
            for what, value, stats, limit in (("loss", loss, self.loss, self.loss_z),
                                              ("grad_norm", grad_norm, self.grad_norm, self.grad_norm_z)):
                if limit is None or value is None:
                    continue
                z = stats.z(value)
                if z > limit:
                    return Verdict(what, value, z, stats.mean, math.sqrt(stats.var), loss, grad_norm)
        self.loss.add(loss)
        if grad_norm is not None:
            self.grad_norm.add(grad_norm)
        return None

    def state_dict(self) -> dict:
        return {"loss": self.loss.state_dict(), "grad_norm": self.grad_norm.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.loss.load_state_dict(state["loss"])
            self.grad_norm.load_state_dict(state["grad_norm"])
