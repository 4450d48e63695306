"""Signals during a run: the first SIGINT / SIGTERM / SIGHUP lets the current step finish, writes a
checkpoint and stops the run (exit 130 / 143 / 129); a second one raises ``Interrupted`` at once.
SIGHUP is left alone when it is ignored at start (nohup).

A run whose parent asked to be told of its death (a sweep's trial: Linux ``PR_SET_PDEATHSIG``,
apr/sweep/trial.py) gets that signal once per thread of the dying parent, as the kernel hands the
orphan from one exiting thread to the next (its parent process id unchanged until the last one):
so for such a run that signal (SIGTERM) stops it once, however often it comes, and once received it
is ignored while the run records its end; a repeat would otherwise abandon the step, or kill the
process before its ``training_state.json`` holds its last evaluations, which a retry carries on.
Another signal (SIGINT) still interrupts at once."""

from __future__ import annotations

import ctypes
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
        self._death = 0  # the parent-death signal (a sweep's trial), read on entry

    def __enter__(self) -> StopSignals:
        if self.enabled:
            self._death = parent_death_signal()
            for sig in SIGNAL_EXIT:
                if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # started under nohup: a hang-up is not meant for this run
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if signum == self._death:  # the worker's stop, or its death told once per thread of it: one stop
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
            again = "SIGINT exits at once" if self.received == self._death else "send it again to exit at once"
            self._echo(f"{signal.Signals(self.received).name}: finishing this step and writing a checkpoint ({again})")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            # a parent-death signal received: its repeats still on their way must not kill the end's records
            signal.signal(sig, signal.SIG_IGN if sig == self.received == self._death else old)
