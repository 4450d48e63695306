"""Early stopping (``training.early_stopping``): a ``StepHook`` that ends the run when the validation
loss has not improved by ``min_delta`` for ``patience`` validations in a row.

The run ends as ``finished`` (exit 0: stopping early is a normal end) with a status reason of its own,
``early stopping: ...``, recorded like every ``Stop`` (state file, both stores, ``runs show``). The
last step's checkpoint is written as for any stop; ``checkpoint-best`` is never pruned by
``keep_last`` (apr.checkpoint.manager), so the best weights survive. Its counters travel in each
checkpoint's meta (``early_stopping``) so a resumed run counts on where it left off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apr.train.stop import StepReport, Stop

if TYPE_CHECKING:
    from apr.train.stop import RunContext as Run

REASON_PREFIX = "early stopping"


class EarlyStopping:
    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience, self.min_delta = int(patience), float(min_delta)
        self.best: float | None = None  # the best validation loss so far (improvements by min_delta only)
        self.best_step: int | None = None
        self.waited = 0  # validations in a row without an improvement

    def observe(self, step: int, val_loss: float) -> Stop | None:
        """Count one validation; the ``Stop`` when the patience runs out."""
        if self.best is None or val_loss < self.best - self.min_delta:
            self.best, self.best_step, self.waited = val_loss, step, 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        kept = "checkpoint-best kept" if self.best_step else "the initial weights were best: no checkpoint-best"
        return Stop("finished", f"{REASON_PREFIX}: val_loss did not improve by {self.min_delta:g} in "
                    f"{self.waited} validations (best {self.best:.4f} at step {self.best_step}; {kept})", 0)

    def after_step(self, run: Run, report: StepReport) -> Stop | None:
        if report.val_loss is None:
            return None
        return self.observe(report.step, report.val_loss)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.best, self.best_step, self.waited = state.get("best"), state.get("best_step"), int(state["waited"])
