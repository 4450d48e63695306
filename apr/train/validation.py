"""Validation during a run: the loss over ``data.val`` (and a mixture's per-source val folders) at the
cadence's steps and at step 0, the best and first losses (for "best" checkpoints and early stopping),
averaged over the data-parallel ranks. A stateful part of the checkpoint (``best_val_loss``,
``first_val_loss``).

Under ``training.reduction: canonical`` the loss does not depend on the world size: the rows are the
first ``training.eval_batches`` micro-batches of ``data.batch_size`` rows on any layout (on one
process, fast's rows), micro-batch ``j`` scored by rank ``j % world``, and their summed losses and
token counts added in the fixed tree over ``j`` (apr/train/reduction.py)."""

from __future__ import annotations

import math
import os

import torch

from apr.data.loader import ShardLoader
from apr.track.forecast import forecast
from apr.train.reduction import canonical_sums


class Validation:
    def __init__(self, config, loader_options: dict, dp, device: torch.device, echo, label,
                 total_steps: int | None = None):
        data, tr = config.data, config.training
        self.eval_batches = tr.eval_batches
        self.dp, self.device, self.echo, self.label = dp, device, echo, label
        self.canonical = str(tr.reduction) == "canonical"
        if self.canonical:  # every rank reads the same micro-batches in order and scores its share
            loader_options = {**loader_options, "rank": 0, "world_size": 1}
        self.val_loader: ShardLoader | None = None
        self.source_vals: dict[str, ShardLoader] = {}
        if tr.eval_interval > 0:
            if data.val is not None:
                self.val_loader = ShardLoader(os.path.expanduser(data.val), shuffle=False, **loader_options)
            self.source_vals = {s.name: ShardLoader(os.path.expanduser(s.val), shuffle=False, **loader_options)
                                for s in data.sources or [] if s.val}
        self.best: float | None = None
        self.first: float | None = None
        self.last: float | None = None  # the last measured validation loss
        self.points: list[tuple[int, float]] = []  # this process's (step, val loss): the forecast's input
        self.total_steps = total_steps  # the run's last step: the step the forecast is for
        self.by_source: dict[str, float | None] = {}  # a mixture's per-source val losses, last measured

    @property
    def configured(self) -> bool:
        return self.val_loader is not None or bool(self.source_vals)

    def measure(self, engine) -> float | None:
        """Validation loss over ``training.eval_batches``; None without a val set. Without data.val a
        mixture's loss is the plain mean of its sources' (the same sources whatever the stage). The
        model is in eval mode meanwhile: no dropout (model.architecture.dropout, LoRA's)."""
        was_training = engine.model.training
        engine.model.eval()
        try:
            self.by_source = {name: self._loss_over(engine, loader) for name, loader in self.source_vals.items()}
            if self.val_loader is not None:
                return self._loss_over(engine, self.val_loader)
        finally:
            engine.model.train(was_training)
        known = [v for v in self.by_source.values() if v is not None]
        return sum(known) / len(known) if known else None

    def _loss_over(self, engine, loader: ShardLoader) -> float | None:
        if self.canonical:
            return self._canonical_loss_over(engine, loader)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        score = getattr(engine.loss, "eval_loss_sum", None)  # a loss part with its own (MaskedLM), else causal
        for batch in loader.iter_sequential(self.eval_batches):
            loss_sum, n = engine.eval_loss_sum(batch) if score is None else score(engine, batch)
            total += loss_sum.double()
            count += n
        if self.dp is not None:
            both = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
            summed = self.dp.sum_(both)  # read what the reduction returns, not the tensor handed in
            total, count = summed[0], int(summed[1].item())
        if count == 0:
            return None
        return float(total.item() / count)

    def _canonical_loss_over(self, engine, loader: ShardLoader) -> float | None:
        """The mean loss over the first ``eval_batches`` micro-batches whatever the world size: each
        micro-batch's summed loss and token count apart, then the fixed tree over the micro-batches."""
        rank, world = (0, 1) if self.dp is None else (self.dp.rank, self.dp.world_size)
        score = getattr(engine.loss, "eval_loss_sum", None)
        first, mine, count = None, [], 0
        for j, batch in enumerate(loader.iter_sequential(self.eval_batches)):
            first = batch if first is None else first
            count += 1
            if j % world == rank:
                mine.append(batch)
        if count == 0:
            return None
        local = []
        for i in range(-(-count // world)):
            # a rank short of a micro-batch scores the first again, never summed: every rank runs as many
            # forwards (FSDP2 gathers the weights inside each)
            batch = mine[i] if i < len(mine) else first
            loss_sum, n = engine.eval_loss_sum(batch) if score is None else score(engine, batch)
            local.append(torch.stack([loss_sum.double().reshape(()),
                                      torch.tensor(float(n), dtype=torch.float64, device=loss_sum.device)]))
        total = canonical_sums(self.dp, local, count)
        return float(total[0].item() / total[1].item())

    def initial(self, engine, recorder) -> float | None:
        """A fresh run measures the initial weights: a later checkpoint is "best" only if it beats them."""
        self.last = self.first = self.best = self.measure(engine)
        recorder.log_eval(0, self.last)
        self._echo(0, self.last, best=False)
        return self.last

    def at(self, step: int, engine, recorder) -> tuple[float | None, bool]:
        """Validation loss at ``step``, recorded and printed, and whether it beats every earlier one."""
        self.last = self.measure(engine)
        recorder.log_eval(step, self.last)
        if self.last is not None:
            self.points.append((step, self.last))
        is_best = self.last is not None and (self.best is None or self.last < self.best)
        if is_best:
            self.best = self.last
        self._echo(step, self.last, is_best)
        if self.by_source:
            self.echo(f"{self.label(step)}  val loss by source: " + "  ".join(
                f"{n} {v:.4f}" for n, v in self.by_source.items() if v is not None))
        return self.last, is_best

    def _echo(self, step: int, val: float | None, best: bool) -> None:
        if val is None:
            return
        ahead = forecast(self.points, self.total_steps) if self.total_steps and step < self.total_steps else None
        self.echo(f"{self.label(step)}  val loss {val:.4f} (ppl {math.exp(min(val, 700)):.1f})"
                  + ("  best" if best else "")
                  + (f"  forecast {ahead.loss:.4f} [{ahead.low:.4f}, {ahead.high:.4f}] at step {ahead.step}"
                     if ahead is not None else ""))

    def state_dict(self) -> dict:
        return {"best_val_loss": self.best, "first_val_loss": self.first}

    def load_state_dict(self, meta: dict) -> None:
        self.best, self.first = meta.get("best_val_loss"), meta.get("first_val_loss")
