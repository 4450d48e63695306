"""A one-line progress bar for `apr train apply` on a terminal; log lines print above it."""

from __future__ import annotations

import sys
import time

from apr.fmt import fmt_duration
from apr.rate import RateMeter


class TerminalProgress:
    """Draws ``[#####.....] step/total pct  elapsed 1m 02s  ETA 3m 10s  4.2 steps/s`` on the last
    line of a TTY (nothing when not a TTY). The rate is an EMA over wall time (apr.rate), so the
    ETA does not jump with each slow or fast step; ETA shows ``–`` until there is a rate.

    Log lines go through ``echo``, which clears the bar, prints the line and draws the bar again, so
    the bar never mixes with the log. Redraws at most 10 times a second.
    """

    WIDTH = 30

    def __init__(self, stream=None, clock=time.monotonic):
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self._line = ""
        self._last = float("-inf")  # the first update always draws
        self._t0 = clock()
        self._meter = RateMeter()

    def echo(self, line: str) -> None:
        if self.enabled and self._line:
            self.stream.write("\r\x1b[K")
        self.stream.write(line + "\n")
        if self.enabled and self._line:
            self.stream.write(self._line)
        self.stream.flush()

    def update(self, step: int, total: int) -> None:
        if not self.enabled:
            return
        now = self.clock()
        self._meter.update(step, now)
        if now - self._last < 0.1 and step < total:
            return
        self._last = now
        self._line = self.line(step, total, now)
        self.stream.write("\r\x1b[K" + self._line)
        self.stream.flush()

    def line(self, step: int, total: int, now: float) -> str:
        frac = min(step / total, 1.0) if total else 1.0
        filled = int(self.WIDTH * frac)
        eta = self._meter.eta(total - step) if step < total else 0.0
        rate = self._meter.rate
        speed = "" if rate is None else f"  {rate:.3g} steps/s"
        return (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {step}/{total} {frac * 100:5.1f}%  "
                f"elapsed {fmt_duration(now - self._t0)}  ETA {fmt_duration(eta)}{speed}")

    def close(self) -> None:
        if self.enabled and self._line:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self._line = ""
