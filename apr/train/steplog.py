"""The run loop's log steps: the loss and norm read to the host, the metrics recorded, one line printed."""

from __future__ import annotations

import time
from collections.abc import Callable

from apr.fmt import fmt_count, fmt_duration, fmt_epoch, fmt_rate
from apr.rate import RateMeter
from apr.track.protocol import Recorder
from apr.train.dist import DataParallel
from apr.train.engine import StepResult
from apr.train.reduction import agreed


class StepLog:
    """Logs a step's metrics. The throughput clock leaves evaluation and checkpoint time out:
    the loop calls ``restart_clock`` after them."""

    def __init__(self, *, total_steps: int, tokens_per_step: int, dp: DataParallel | None,
                 echo: Callable[[str], None], label: Callable[[int], str],
                 shown: tuple[str, ...] = ("loss", "learning_rate", "gradient_norm"), canonical: bool = False):
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.canonical = canonical  # training.reduction: canonical: the step's loss is the tree's, as it is
        self.shown = shown  # monitoring.terminal.metrics: what the printed line holds, in order
        self.dp, self.echo, self.label = dp, echo, label
        self.loss: float | None = None  # the last logged loss (averaged over ranks; canonical: the tree's)
        self.tokens_per_s: float | None = None  # the last interval's throughput
        self._t, self._step = time.perf_counter(), 0
        self._meter = RateMeter()  # the printed tok/s and ETA: an EMA over wall time, not one interval
        # monitoring.block_norms: ``lr -> metrics`` of the step just taken (apr/train/blocknorms.py)
        self.block_norms: Callable[..., dict] | None = None
        self.mfu: Callable[[float | None], dict] | None = None  # tokens/s -> mfu, hfu (apr/train/mfu.py)
        # model.architecture.moe: ``dp -> metrics`` of the step's routing (apr/train/losses.py RoutingBalance)
        self.moe: Callable[[DataParallel | None], dict] | None = None

    def start(self, step: int) -> None:
        """The loop starts (or resumes) after ``step``."""
        self._t, self._step = time.perf_counter(), step

    def restart_clock(self) -> None:
        self._t = time.perf_counter()

    def log(self, step: int, lr: float, result: StepResult, epoch: float, recorder: Recorder) -> dict:
        self.loss = float(agreed(self.dp, result.loss, self.canonical).item())
        gn = float(result.grad_norm.item())
        now = time.perf_counter()
        tokens, seconds = (step - self._step) * self.tokens_per_step, max(now - self._t, 1e-9)
        self.tokens_per_s = tokens / seconds
        self._t, self._step = now, step
        metrics = {"loss": self.loss, "lr": lr, "grad_norm": gn, "tokens_per_s": self.tokens_per_s,
                   "epoch": epoch, "tokens_seen": step * self.tokens_per_step}
        if result.skipped:
            metrics["skipped_steps"] = 1
        if self.mfu is not None:
            metrics.update(self.mfu(self.tokens_per_s))
        if self.block_norms is not None:
            metrics.update(self.block_norms(lr))
        if self.moe is not None:
            metrics.update(self.moe(self.dp))
        recorder.log_step(step, metrics)
        smooth = self._meter.add(tokens, seconds) or self.tokens_per_s
        eta = self._meter.eta((self.total_steps - step) * self.tokens_per_step)
        fields = {"loss": f"loss {self.loss:.4f}", "learning_rate": f"lr {lr:.2e}", "gradient_norm": f"gnorm {gn:.3f}",
                  "epoch": f"epoch {fmt_epoch(epoch)}", "tokens_seen": f"tokens {fmt_count(metrics['tokens_seen'])}"}
        shown = "".join(f"  {fields[name]}" for name in self.shown)
        self.echo(f"{self.label(step)}{shown}  {fmt_rate(smooth)} tok/s  eta {fmt_duration(eta)}")
        return metrics
