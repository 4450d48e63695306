"""A one-line progress bar for `apr train apply` on a terminal; log lines print above it."""

from __future__ import annotations

import sys
import time


class TerminalProgress:
    """Draws ``[#####.....] step/total pct`` on the last line of a TTY (nothing when not a TTY).

    Log lines go through ``echo``, which clears the bar, prints the line and draws the bar again, so
    the bar never mixes with the log. Redraws at most 10 times a second.
    """

    WIDTH = 30

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._line = ""
        self._last = 0.0
        self._t0 = time.monotonic()

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
        now = time.monotonic()
        if now - self._last < 0.1 and step < total:
            return
        self._last = now
        frac = step / total if total else 1.0
        filled = int(self.WIDTH * frac)
        elapsed = now - self._t0
        self._line = (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {step}/{total} {frac * 100:5.1f}%  "
                      f"{elapsed:.0f}s")
        self.stream.write("\r\x1b[K" + self._line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._line:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self._line = ""
