"""Marks on a timeline that cost next to nothing to take: ``perf_counter`` on the CPU (work is
synchronous there) and CUDA events on a GPU, read once after the step, so timing a layer never
synchronises the device in the middle of the step it measures."""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """Seconds from mark ``start`` to mark ``end`` (after ``sync``)."""
        if self.cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the two nearest ranks, as
    numpy's default does; one value is its own percentile."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
