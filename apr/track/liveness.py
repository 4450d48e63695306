"""Is the trainer behind a recorded run still alive? Asked only where the answer is certain: the run
was recorded on this host, so its PID can be looked up here.

A PID is recycled once its process is gone, so a live PID is the run's trainer only if that process
started before the run's last heartbeat (the trainer wrote it, so it was running then); one that
started later, a zombie, or a process that is neither Python nor apr is another process, and the
run's trainer is dead. Standard library only (``/proc`` on Linux; elsewhere just ``os.kill(pid, 0)``).
"""

from __future__ import annotations

import errno
import os
import socket
from functools import lru_cache

START_SLACK_S = 5.0  # /proc gives clock ticks after a boot time in whole seconds; wall-clock steps


@lru_cache(maxsize=1)
def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _proc_stat(pid: int) -> tuple[str, float | None] | None:
    """(state letter, start time as Unix time) of ``pid`` from /proc, or None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except FileNotFoundError:
        return ("gone", None)
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    try:
        state, ticks = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None
    boot = _boot_time()
    start = None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")
    return state, start


def _looks_like_a_trainer(pid: int) -> bool | None:
    """Whether ``pid``'s command line names Python or apr (None: it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return None
    names = [os.path.basename(w).decode("utf-8", "replace").lower() for w in words[:4] if w]
    if not names:
        return None  # a kernel thread or a process being torn down: no verdict from the name
    return any(n.startswith("python") or n in ("apr", "torchrun", "pytest") or "apr" in n.split(".") for n in names)


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def trainer_alive(host: object, pid: object, heartbeat: object, this_host: str | None = None) -> bool | None:
    """True: the run's trainer still runs on this host; False: it is gone (its PID is free, a zombie,
    or now another process); None: unknown (another host, no PID recorded)."""
    if not isinstance(host, str) or not host or isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    if host != (this_host if this_host is not None else socket.gethostname()):
        return None
    if pid == os.getpid():
        return True
    if not pid_exists(pid):
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc (macOS): the PID exists, nothing more can be known
    state, started = stat
    if state in ("gone", "Z", "X"):  # exited (a zombie waits for its parent to reap it)
        return False
    if (started is not None and isinstance(heartbeat, (int, float)) and not isinstance(heartbeat, bool)
            and started > heartbeat + START_SLACK_S):
        return False  # started after the trainer's last write: the PID was reused
    return _looks_like_a_trainer(pid) is not False
