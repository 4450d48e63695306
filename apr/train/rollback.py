"""Spike rollback (``training.rollback``; docs/design.md, "Surviving spikes").

``SpikeWatch`` reads each step's loss (averaged over ranks) against an EMA of the loss over the
steps that were not spikes: a step above ``threshold x EMA`` is a spike step; ``patience`` of them
in a row trigger a rollback over the window from the first of them to the trigger.

``RollbackState`` is what a rollback leaves behind for the rest of the run, and it travels in every
checkpoint's meta (``rollback``) so a run killed at any point of a rollback resumes into the same
decision: the data window still to skip (as global micro-batch numbers of the data cursor), the
lowered learning rate's last step, and how many rollbacks the run has made. ``Survival._roll_back``
(apr/train/survive.py) restores the newest checkpoint older than the window (the restore service,
apr/train/restore.py, keeping this state as it is), rewrites
it at once with this state (so a kill from then on resumes past the window), records the event
with the exact rows skipped, and trains on: the steps between the checkpoint and the window are
replayed on the same rows, the window's rows are skipped, and the steps keep their numbers (the
run still ends at ``total_steps``; the LR schedule is the same function of the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apr.train.badsteps import RunningStats


class SpikeWatch:
    def __init__(self, threshold: float, patience: int, window: int, min_history: int):
        self.threshold, self.patience, self.min_history = float(threshold), int(patience), int(min_history)
        self.ema = RunningStats(window)
        self.since: int | None = None  # first step of the spike in progress
        self.count = 0  # spike steps in a row

    @classmethod
    def of(cls, rb) -> SpikeWatch | None:
        """From ``training.rollback``; None when no threshold is set."""
        if rb.threshold is None:
            return None
        return cls(rb.threshold, rb.patience, rb.window, rb.min_history)

    @property
    def in_spike(self) -> bool:
        return self.since is not None

    def limit(self) -> float | None:
        return self.threshold * self.ema.mean if self.ema.count >= self.min_history else None

    def observe(self, step: int, loss: float) -> int | None:
        """Count ``step``'s loss; the first step of the window when this step triggers a rollback."""
        limit = self.limit()
        if limit is not None and not loss <= limit:  # NaN counts as a spike
            if self.since is None:
                self.since = step
            self.count += 1
            return self.since if self.count >= self.patience else None
        self.since, self.count = None, 0
        self.ema.add(loss)
        return None

    def reset(self) -> None:
        self.since, self.count = None, 0

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "since": self.since, "count": self.count}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.ema.load_state_dict(state["ema"])
            self.since, self.count = state.get("since"), int(state.get("count", 0))


@dataclass
class RollbackState:
    rollbacks: int = 0  # rollbacks made so far
    skips: list[dict] = field(default_factory=list)  # [{"at": micro-batch, "count": n}] still ahead
    lr_factor: float = 1.0
    lr_until: int = 0  # the lowered LR applies to steps <= lr_until
    events: list[dict] = field(default_factory=list)  # each rollback's record {"step", "message", "detail"}

    def lr(self, step: int, lr: float) -> float:
        return lr * self.lr_factor if step <= self.lr_until else lr

    def due_skip(self, absolute: int) -> dict | None:
        """The window to skip when the data cursor stands at its start."""
        for skip in self.skips:
            if skip["at"] == absolute:
                return skip
        return None

    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "skips": [dict(s) for s in self.skips],
                "lr_factor": self.lr_factor, "lr_until": self.lr_until, "events": [dict(e) for e in self.events]}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.rollbacks = int(state["rollbacks"])
            self.skips = [dict(s) for s in state.get("skips", [])]
            self.lr_factor, self.lr_until = float(state.get("lr_factor", 1.0)), int(state.get("lr_until", 0))
            self.events = [dict(e) for e in state.get("events", [])]


def ledger_rows(loader, first: int, count: int) -> list[dict]:
    """The rows of global micro-batches ``first .. first + count - 1``: one entry per row with the
    micro-batch number, the shard file and the row inside it (the bad-batch ledger's rows)."""
    out = []
    for absolute in range(first, first + count):
        for index in loader.rows_at(absolute):
            shard, row = loader.locate(index)
            out.append({"micro_batch": absolute, "index": index, "shard": shard, "row": row})
    return out
