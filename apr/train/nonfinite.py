"""Non-finite detection on the device (docs/design.md, "The engines"): sticky flags that the
engine feeds to every AdamW launch as ``found_inf`` and that the host reads only when it asks.

Once a step's loss or gradient is NaN/inf, ``bad`` stays set: that step's remaining updates and
every later step's write nothing, so the weights stay those before the first bad step until the
caller reads the flags (``read``, one host read) and stops."""

from __future__ import annotations

import torch

WHAT = {1: "loss", 2: "gradients"}
LOSS, GRADIENTS = 1, 2


class NonFiniteFlags:
    def __init__(self, device: torch.device):
        self.bad = torch.zeros((), dtype=torch.bool, device=device)  # the AdamW launches' found_inf
        # [call number of the first bad step (0: none), what (LOSS/GRADIENTS), some group updated before it]
        self._record = torch.zeros(3, dtype=torch.int64, device=device)
        self._stepped = torch.zeros((), dtype=torch.bool, device=device)  # a group of this step was updated
        self._read_at = 0

    def start_step(self) -> None:
        self._stepped.zero_()

    def flag(self, bad_now: torch.Tensor, what: int, call: int) -> None:
        """Record ``bad_now`` (a 0-dim bool device tensor) for ``train_step`` call number ``call``."""
        first = bad_now & ~self.bad
        here = torch.stack([torch.full_like(self._record[0], call), torch.full_like(self._record[0], what),
                            self._stepped.long()])
        self._record.copy_(torch.where(first, here, self._record))
        self.bad |= bad_now

    def stepped(self) -> None:
        """A group was just updated (unless ``bad``): a later bad gradient in this step is partial."""
        self._stepped |= ~self.bad

    def read(self, calls: int) -> tuple[str, int, bool] | None:
        """None if no step up to call ``calls`` was bad, else (what, steps not in the weights,
        partial); then the flags are cleared. Skips the host read when no step ran since the last."""
        if calls == self._read_at:
            return None
        self._read_at = calls
        first, what, partial = self._record.tolist()
        if first == 0:
            return None
        self.bad.zero_()
        self._record.zero_()
        return WHAT[what], calls - first + 1, bool(partial)
