"""Signals during a run: the first SIGINT / SIGTERM / SIGHUP lets the current step finish, writes a
checkpoint and stops the run (exit 130 / 143 / 129); a second one raises ``Interrupted`` at once.
SIGHUP is left alone when it is ignored at start (nohup)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM/SIGHUP: stop at once, mid-step, without a checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """First SIGINT/SIGTERM/SIGHUP: ask the loop to stop after this step (``received``). Second: exit at once."""

    def __init__(self, enabled: bool, echo: Callable[[str], None]):
        self.received: int | None = None
        self.announced = False
        self._echo = echo
        self._old: dict[int, object] = {}
        self.enabled = enabled and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for sig in SIGNAL_EXIT:
                if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # started under nohup: a hang-up is not meant for this run
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.received is not None:
            raise Interrupted(signum)  # unwinds the step at once; the loop records it and exits
        self.received = signum  # no printing here: the handler may run inside a write to the same stream

    def announce(self) -> None:
        """Say, once, from the loop, that a signal is stopping the run."""
        if self.received is not None and not self.announced:
            self.announced = True
            self._echo(f"{signal.Signals(self.received).name}: finishing this step and writing a checkpoint "
                       "(send it again to exit at once)")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
