"""Standard output and error that can vanish under a long command without costing it anything.

`apr train apply cfg.yaml 2>&1 | tee log` and Ctrl-C: the terminal's SIGINT also ends `tee`, so
apr's next line meets a closed pipe (EPIPE); an SSH session that drops leaves a terminal that
answers EIO. Python would raise ``BrokenPipeError`` from whichever ``print`` came next: in the
middle of a step, or of writing a checkpoint. ``guard_std_streams`` replaces ``sys.stdout`` and
``sys.stderr`` with streams that, on such an error, point the file descriptor at /dev/null and
carry on silently: the run finishes its step, writes its checkpoint and its records (which are
the real log) and exits with its own code. See docs/training.md, "Stopping".
"""

from __future__ import annotations

import errno
import io
import os
import sys

# a reader that went away (EPIPE), a terminal that hung up (EIO), a descriptor closed under us (EBADF)
GONE = (errno.EPIPE, errno.EIO, errno.EBADF, errno.ENXIO)


def _to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        if null != fd:
            os.close(null)


class SilencingWriter(io.RawIOBase):
    """A raw writer over one file descriptor that goes quiet for good when its reader is gone."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd
        self.silenced = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return not self.silenced and os.isatty(self.fd)

    def write(self, data) -> int:
        n = len(data)
        if self.silenced:
            return n
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as err:
            if err.errno not in GONE:
                raise
            self.silenced = True
            _to_devnull(self.fd)  # later writes, by anything holding this descriptor, land nowhere
        return n


def _guarded(fd: int, old) -> io.TextIOWrapper:
    raw = SilencingWriter(fd)
    encoding = getattr(old, "encoding", None) or "utf-8"
    errors = getattr(old, "errors", None) or "backslashreplace"
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, errors=errors, line_buffering=True,
                            write_through=True)


def guard_std_streams() -> None:
    """Make stdout and stderr of this process silence themselves when their reader is gone.

    Descriptors 0-2 that are closed at start are pointed at /dev/null first, so no file apr opens
    later (a checkpoint) can receive them. Streams already replaced (a test runner capturing
    output, or an earlier call) are left alone."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            if fd == 0:
                null = os.open(os.devnull, os.O_RDONLY)
                if null != 0:
                    os.dup2(null, 0)
                    os.close(null)
            else:
                _to_devnull(fd)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        current = getattr(sys, name)
        if current is not None and current is not getattr(sys, f"__{name}__"):
            continue  # captured by a caller: its writes never reach a descriptor
        if current is not None:
            try:
                current.flush()
            except OSError:
                pass
        # sys.__stdout__ / __stderr__ keep the originals alive: collecting them would close fds 1 and 2
        setattr(sys, name, _guarded(fd, current))
