"""Background checkpoint writes (``training.checkpoint_async``; docs/design.md, "Checkpoints").

The trainer thread blocks only for the snapshot: every tensor of the state copied to host memory
(one copy: the device buffers go on changing). The safetensors file, its JSON, the best link and
the pruning then happen on one writer thread, with the manager's own atomic writes, so a process
killed during a background write leaves what a killed synchronous write leaves: a temp file that
never looks complete, and the previous checkpoints. At most one write is in flight: a save while
one is still writing waits for it first (bounded host memory: one snapshot). A write that fails
(a full disk) raises in the trainer thread at its next ``poll``/``wait``/``save``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def snapshot(tensors: dict[str, Any]) -> dict[str, Any]:
    """Host copies of ``tensors`` (pinned for a fast device-to-host copy where CUDA is in use)."""
    import torch  # lazy: the checkpoint package is imported by torch-free commands

    out = {}
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type == "cpu":
            out[name] = t.clone()
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
    if any(t.device.type == "cuda" for t in tensors.values()):
        torch.cuda.synchronize()
    return out


class BackgroundWriter:
    """One writer thread, one write in flight; completed writes are collected by the caller."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._done: list[tuple[int, Path, bool]] = []  # (step, json path, is_best) written, not yet collected
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, is_best: bool, write: Callable[[], Path]) -> None:
        """Run ``write`` (returns the checkpoint's JSON path) on the writer thread, after the one
        in flight."""
        self.wait_idle()

        def run() -> None:
            try:
                path = write()
            except BaseException as e:  # re-raised in the trainer thread
                with self._lock:
                    self._error = e
                return
            with self._lock:
                self._done.append((step, path, is_best))

        self._thread = threading.Thread(target=run, name=f"apr-checkpoint-{step}", daemon=False)
        self._thread.start()

    def wait_idle(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def collect(self) -> list[tuple[int, Path, bool]]:
        """The writes finished since the last call, oldest first; raises a failed write's error."""
        self._raise()
        with self._lock:
            done, self._done = self._done, []
        return done

    def _raise(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
