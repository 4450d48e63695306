"""The run loop's defences against bad steps and loss spikes (docs/design.md, "Surviving spikes"):
``training.bad_steps`` (apr/train/badsteps.py: a flagged step applies no update) and
``training.rollback`` (apr/train/rollback.py: a persistent spike restores the newest checkpoint
older than it and skips its data window). Both are recorded as run events (``bad_step``,
``rollback``) with the exact rows involved: the bad-batch ledger (``apr runs ledger``).

With either on, the loop reads the step's loss on the host every step (and the gradient norm when
``bad_steps.grad_norm_z`` is set): the decisions are made on exact figures, not on log steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from apr.checkpoint.manager import scan
from apr.train.badsteps import BadStepTest
from apr.train.reduction import agreed
from apr.train.restore import Saved, restore
from apr.train.rollback import RollbackState, SpikeWatch, ledger_rows
from apr.train.stop import Stop

if TYPE_CHECKING:
    from apr.track.protocol import Recorder
    from apr.train.stop import RunContext as Run
    from apr.train.stop import StepReport


class Survival:
    def __init__(self, plan):
        self.config = config = plan.config  # plan: apr.steps.resolved.Resolved
        self.bad_steps = BadStepTest.of(config.training.bad_steps)
        self.spikes = SpikeWatch.of(config.training.rollback)
        self.rollback = RollbackState()
        self.verdict = None  # the last step's bad-step verdict (None: not flagged)
        self.save_deferred = False  # a checkpoint fell due during a spike: written when it ends
        self.unflushed = False  # bad_step events not yet on disk (flushed before the next checkpoint)

    @property
    def enabled(self) -> bool:
        return self.bad_steps is not None or self.spikes is not None

    # ------------------------------------------------------------------------------ per step

    def gate(self, run: Run, loss: torch.Tensor, norm: torch.Tensor | None) -> bool:
        """The engine's ``step_gate``: the bad-step test on this step's figures, before any update.
        Under DDP the figures are averaged first, so every rank decides alike."""
        figures = torch.stack([loss.detach().float().reshape(()),
                               (norm if norm is not None else loss).detach().float().reshape(())])
        figures = agreed(run.dp, figures, run.plan.reduction == "canonical")  # canonical: global already
        mean_loss, grad_norm = figures.tolist()
        self.verdict = self.bad_steps.verdict(mean_loss, grad_norm if norm is not None else None)
        return self.verdict is not None

    def lr(self, step: int, lr: float) -> float:
        return self.rollback.lr(step, lr)

    def before_batches(self, run: Run, recorder: Recorder) -> None:
        """Skip a rollback's data window when the data cursor reaches its start."""
        skip = self.rollback.due_skip(run.loader.absolute)
        if skip is not None:
            run.loader.seek(skip["at"] + skip["count"])
            run.echo(f"{run.step_label(run.step)}  skipping {skip['count']} micro-batches of data "
                     f"(rolled back; see `apr runs ledger {run.run_id}`)")

    def after_step(self, run: Run, report: StepReport, recorder: Recorder) -> Stop | bool:
        """Record a flagged step; watch for spikes. True: rolled back (the loop goes on from the
        restored step); a ``Stop``: the run ends; False: nothing happened."""
        step = report.step
        if report.result.flagged and self.verdict is not None:
            v = self.verdict
            detail = {**v.to_dict(), **self._window(run, step, step)}
            recorder.log_event("bad_step", step, v.message(), detail)
            self.unflushed = True
            run.echo(f"{run.step_label(step)}  {v.message()}")
        if self.spikes is None:
            return False
        loss = float(agreed(run.dp, report.result.loss, run.plan.reduction == "canonical").item())
        ema, limit = self.spikes.ema.mean, self.spikes.limit()
        start = self.spikes.observe(step, loss)
        if start is None:
            return False
        return self._roll_back(run, start, step, loss, ema, limit, recorder)

    def before_save(self, recorder: Recorder) -> None:
        """The bad_step events go to disk before a checkpoint that goes past their steps (a kill
        after it cannot lose them: those steps will not be trained again)."""
        if self.unflushed:
            recorder.flush()
            self.unflushed = False

    def restore_records(self, recorder: Recorder) -> None:
        """A resumed run records the rollbacks its checkpoint decided that the records lack (the
        process died between the checkpoint and the records)."""
        recorded = {(e.get("detail") or {}).get("attempt") for e in recorder.recorded_events()
                    if e.get("kind") == "rollback"}
        for event in self.rollback.events:
            if event["detail"]["attempt"] not in recorded:
                recorder.log_event("rollback", event["step"], event["message"], event["detail"])

    def save_due(self, due: bool, forced: bool) -> bool:
        """A checkpoint never holds the weights of a spike in progress (the rollback's target must
        predate it): one due then is written at the first step after the spike, unless the run ends."""
        if self.spikes is None or forced:
            self.save_deferred = False
            return due
        if self.spikes.in_spike:
            self.save_deferred = self.save_deferred or due
            return False
        if self.save_deferred:
            self.save_deferred = False
            return True
        return due

    # ------------------------------------------------------------------------------ rollback

    def _window(self, run: Run, start: int, end: int) -> dict:
        """The data of steps ``start .. end`` (the last ones drawn): micro-batch numbers and rows."""
        accum = run.config.training.gradient_accumulation
        count = (end - start + 1) * accum
        first = run.loader.absolute - count
        return {"micro_batches": [first, count], "rows": ledger_rows(run.loader, first, count)}

    def _roll_back(self, run: Run, start: int, step: int, loss: float, ema: float, limit: float | None,
                   recorder: Recorder) -> Stop | bool:
        cfg, rb = self.config.training.rollback, self.rollback
        what = f"the loss stayed above {cfg.threshold:g} x its EMA ({ema:.4g}) for steps {start}-{step}"
        if rb.rollbacks >= cfg.max_rollbacks:
            return Stop("failed", f"rollback: {what} after {rb.rollbacks} rollbacks "
                        "(training.rollback.max_rollbacks); the last good checkpoint is kept", 1)
        if run.is_main:
            run.record_checkpoints(recorder, wait=True)  # the background write in flight is on disk
        targets = [e for e in scan(run.run_dir) if e.complete and e.step < start]
        if not targets:
            return Stop("failed", f"rollback: {what}, and no checkpoint older than step {start} is left to "
                        "roll back to (checkpoint more often: training.save_interval)", 1)
        window = self._window(run, start, step)
        kept = rb.state_dict()  # the run's rollback history outlives the restore
        run.echo(f"{run.step_label(step)}  rollback: {what}; restoring {targets[0].json_path.name}")
        saved = Saved(*run.load_checkpoint(targets[0].json_path))
        # every rank has read the checkpoint before rank 0 writes its step again below (deleting its
        # files: on NFS another host's open file then goes stale): ``restore`` waits for the ranks
        restored, json_path = restore(run, saved), saved.path
        rb.load_state_dict(kept)
        rb.rollbacks += 1
        first, count = window["micro_batches"]
        rb.skips.append({"at": first, "count": count})
        if cfg.lr_steps and cfg.lr_factor != 1.0:
            rb.lr_factor, rb.lr_until = cfg.lr_factor, start + cfg.lr_steps - 1
        self.save_deferred = False
        lowered = (f"; lr x {rb.lr_factor:g} for steps {start}-{rb.lr_until}" if rb.lr_until >= start else "")
        message = (f"rollback {rb.rollbacks}/{cfg.max_rollbacks}: {what}; restored step {restored} "
                   f"({json_path.name}), skipping the data of steps {start}-{step} ({len(window['rows'])} rows)"
                   + lowered)
        event = {"step": step, "message": message, "detail": {
            "restored_step": restored, "checkpoint": str(json_path), "steps": [start, step], "loss": loss,
            "ema": ema, "limit": limit, "attempt": rb.rollbacks, "lr_factor": rb.lr_factor,
            "lr_until": rb.lr_until if rb.lr_until >= start else None, **window}}
        rb.events.append(event)
        # The decision first (a kill from here on resumes past the window, and the resumed run
        # records the event if this one could not: ``restore_records``), then the records.
        run.save(restored, False, recorder)
        if run.is_main:  # on disk before anything says it happened: a kill after the message must
            run.record_checkpoints(recorder, wait=True)  # not resume from the undecided checkpoint
        recorder.rewind(restored)
        recorder.log_event("rollback", step, message, event["detail"])
        recorder.flush()
        run.echo(f"{run.step_label(step)}  {message}")
        run.steplog.start(restored)
        return True

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"bad_steps": self.bad_steps.state_dict() if self.bad_steps else None,
                "spikes": self.spikes.state_dict() if self.spikes else None,
                "rollback": self.rollback.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        if self.bad_steps is not None:
            self.bad_steps.load_state_dict(state.get("bad_steps"))
        if self.spikes is not None:
            self.spikes.load_state_dict(state.get("spikes"))
        self.rollback.load_state_dict(state.get("rollback"))
