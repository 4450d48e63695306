"""Why a run ends (``Stop``) and the plug-in point of the run loop (``StepHook``).

A ``Stop`` is made where the decision is made (an alert, a signal, a non-finite step, a hook) and
carried unchanged to the recorder and to ``RunResult``: status, reason and exit code travel together.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from apr.train.signals import SIGNAL_EXIT

if TYPE_CHECKING:
    import torch

    from apr.config.schema import AprConfig
    from apr.track.protocol import Recorder
    from apr.train.engine import StepResult


@dataclass(frozen=True)
class Stop:
    status: str  # finished | stopped | failed
    reason: str | None
    exit_code: int
    checkpoint: bool = True  # the loop writes a checkpoint of the step it stops at (not for a critical alert)

    @classmethod
    def alert(cls, message: str) -> Stop:
        return cls("stopped", f"alert: {message}", 1)

    @classmethod
    def critical(cls, message: str) -> Stop:
        """A critical alert says the state itself is bad: stop at once, and keep the last checkpoint
        as the newest (docs/runs.md, "Alerts")."""
        return cls("stopped", f"alert (critical): {message}; no checkpoint written of this step", 1,
                   checkpoint=False)

    @classmethod
    def signal(cls, signum: int, step: int) -> Stop:
        name = signal.Signals(signum).name
        return cls("stopped", f"{name} at step {step}; resume with --resume latest", SIGNAL_EXIT[signum])

    @classmethod
    def interrupted(cls, signum: int, step: int) -> Stop:
        name = signal.Signals(signum).name
        return cls("stopped", f"second {name} during step {step}: stopped at once; resume from the last checkpoint",
                   SIGNAL_EXIT.get(signum, 130))

    @classmethod
    def non_finite(cls, what: str, step: int) -> Stop:
        return cls("failed", f"non-finite {what} at step {step}", 1)


FINISHED = Stop("finished", None, 0)


def first_stop(earlier: Stop | None, later: Stop | None) -> Stop | None:
    """Two decisions of one step: the earlier one stands (both sides are evaluated by the caller)."""
    return earlier if earlier is not None else later


@dataclass
class StepReport:
    """What one optimizer step produced, as the loop's components filled it in."""

    step: int
    lr: float
    result: StepResult  # the engine's loss and gradient norm (device tensors)
    is_last: bool
    metrics: dict | None = None  # the logged metrics (None: not a log step)
    val_loss: float | None = None  # validation loss measured at this step (None: not measured)
    is_best: bool = False  # val_loss beat every earlier one (a "best" checkpoint is written)
    signal: int | None = None  # the signal every rank agreed, after the step's compute, that it stops for


class RunContext(Protocol):
    """What the run loop shows its components (hooks, survival, drift, calibration): a narrow view of
    the run, so they never import the run loop (docs/design.md, "The composed engine")."""

    config: AprConfig
    device: torch.device
    dp: Any  # apr.train.dist.DataParallel | None
    engine: Any  # apr.train.engine.Engine
    loader: Any  # the shard or mixture loader
    recorder: Recorder
    run_id: str | None
    run_dir: Path
    is_main: bool
    step: int
    start_step: int
    tokens_per_step: int
    steplog: Any

    def echo(self, line: str) -> None: ...
    def step_label(self, step: int) -> str: ...
    def check_alerts(self, metrics: dict, step: int, recorder: Recorder) -> Stop | None: ...
    def load_checkpoint(self, which: str | Path) -> tuple: ...
    def save(self, step: int, is_best: bool, recorder: Recorder) -> Path: ...
    def record_checkpoints(self, recorder: Recorder, wait: bool = False) -> None: ...


class StepHook(Protocol):
    """Called by the run loop after each step's logging and evaluation, before the checkpoint decision.
    Return None to go on, or a ``Stop`` to end the run after this step (its checkpoint is written)."""

    def after_step(self, run: RunContext, report: StepReport) -> Stop | None: ...


def agree(stop: Stop | None, signals, dp) -> tuple[Stop | None, int | None]:
    """This step's stop and signal, the same on every rank (docs/design.md, "The run loop").

    ``signals.received`` is read once, here: a signal that arrives later is seen at the next
    agreement, so every decision of the step after it uses the returned value, never the live one.
    Under DDP one all-reduce of three host integers (``DataParallel.any_host``: gloo, nothing read
    from the device) makes a stop or a signal on any rank every rank's; a rank that learns of
    another's signal records it, so a second one there exits at once."""
    signal = signals.received
    if dp is None:
        return stop, signal
    sig, stopped, no_save = dp.any_host([signal or 0, int(stop is not None),
                                         int(stop is not None and not stop.checkpoint)])
    if sig and signals.received is None:
        signals.received = sig
    if stopped and stop is None:
        stop = Stop("stopped", "stopped on another rank (rank 0's records say why)", 1, checkpoint=not no_save)
    return stop, sig or None
