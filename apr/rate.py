"""Throughput that does not jump: an exponential moving average of a rate over wall time.

A per-interval rate swings with every hiccup (a checkpoint write, an evaluation, another process
on the machine) and the ETA derived from it swings more. ``RateMeter`` weights each interval by
its duration, ``1 - exp(-dt / time_constant_s)``, so a long slow interval counts more than a short
fast one and the estimate settles within a few time constants. Standard library only."""

from __future__ import annotations

import math


class RateMeter:
    """``update(done, now)`` with a running count (steps, tokens) and a clock reading in seconds;
    ``rate`` is the smoothed count per second, ``eta(remaining)`` the seconds left at that rate."""

    def __init__(self, time_constant_s: float = 20.0):
        self.time_constant_s = time_constant_s
        self.rate: float | None = None
        self._last: tuple[float, float] | None = None  # (done, now) of the previous update

    def update(self, done: float, now: float) -> float | None:
        if self._last is None:
            self._last = (done, now)
            return self.rate
        last_done, last_now = self._last
        if now <= last_now or done <= last_done:
            return self.rate
        self._last = (done, now)
        return self.add(done - last_done, now - last_now)

    def add(self, count: float, seconds: float) -> float | None:
        """One measured interval: ``count`` done in ``seconds`` (for callers that leave pauses,
        such as evaluations, out of the clock)."""
        if seconds <= 0 or count <= 0:
            return self.rate
        instant = count / seconds
        if self.rate is None:
            self.rate = instant
        else:
            self.rate += (1.0 - math.exp(-seconds / self.time_constant_s)) * (instant - self.rate)
        return self.rate

    def eta(self, remaining: float) -> float | None:
        if self.rate is None or self.rate <= 0 or remaining < 0:
            return None
        return remaining / self.rate
