"""Signals during a run: the first SIGINT / SIGTERM / SIGHUP lets the current step finish, writes a
checkpoint and stops the run (exit 130 / 143 / 129); a second one raises ``Interrupted`` at once.
SIGHUP is left alone when it is ignored at start (nohup).

A run whose parent asked to be told of its death (a sweep's trial: Linux ``PR_SET_PDEATHSIG``,
apr/sweep/trial.py) gets that signal once per thread of the dying parent, as the kernel hands the
orphan from one exiting thread to the next: those repeats are one stop, not a second signal (which
would abandon the step, or kill the process while it records the end of the run)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2  # linux/prctl.h


def _prctl(option: int, arg) -> bool:
    if sys.platform != "linux":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_death_signal() -> int:
    """The signal this process gets when its parent dies (``PR_SET_PDEATHSIG``); 0 when none."""
    value = ctypes.c_int(0)
    return value.value if _prctl(PR_GET_PDEATHSIG, ctypes.byref(value)) else 0


def clear_parent_death_signal() -> None:
    """No more parent-death signals: the one received already stops the run."""
    _prctl(PR_SET_PDEATHSIG, 0)


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
        self._parent, self._death = 0, 0  # the parent process and its death signal, read on entry

    def __enter__(self) -> StopSignals:
        if self.enabled:
            self._parent, self._death = os.getppid(), parent_death_signal()
            for sig in SIGNAL_EXIT:
                if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # started under nohup: a hang-up is not meant for this run
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if signum == self._death and os.getppid() != self._parent:  # the parent died (told once per thread of it)
            clear_parent_death_signal()
            if self.received in (None, signum):
                self.received = signum
                return
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
