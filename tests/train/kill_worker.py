"""``apr ARGS`` (the real CLI, in this process) with a SIGKILL trap, for the kill-anywhere tests
(tests/train/test_kill_anywhere.py). Launched as ``python kill_worker.py ARGS...`` (forked from the
test worker's server, tests/distributed/ranks.py).

The trap counts the file-system changes the process makes under ``APR_TEST_ROOT`` (the test's
folder: the run folder and ``APR_HOME`` with its caches): opening a file to write, creating a
folder, renaming, linking and removing, from any thread (the background checkpoint writer's too).

* ``APR_TEST_FS_LOG=FILE``: each change is appended to FILE as ``N KIND PATH`` (the reference run
  lists them, so a test can spread its kills over the whole run);
* ``APR_TEST_KILL_AT=N``: SIGKILL this process just before its N-th change;
  ``KIND:REGEX``: just before its first change of that kind (``open``, ``replace``, ...) to a file
  whose path matches REGEX; ``KIND*K:REGEX``: before the K-th such change; ``KIND+``: just after it
  (a file opened to write and still empty). The moments: inside a checkpoint's JSON write, its
  weights renamed into place but not their JSON, a record half replaced, a cache row being written;
* ``APR_TEST_KILL_IN=MODULE:QUALNAME:N:WHEN``: SIGKILL at the N-th call of that function, on entry
  (``WHEN`` = ``enter``) or as it returns (``exit``): a moment named by what the run is doing (a
  stacking grow, an orchestrator's branch or decision).
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import re
import signal
import sys
import threading

ROOT = os.environ.get("APR_TEST_ROOT")
LOG = os.environ.get("APR_TEST_FS_LOG")
KILL_AT = os.environ.get("APR_TEST_KILL_AT") or ""
_count = 0
_lock = threading.Lock()
_orig_open = builtins.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_spec() -> tuple[str, int, bool, re.Pattern | None]:
    """(kind, count, after, name pattern) of a ``KIND[*K][+]:REGEX`` trap; kind '' for none."""
    if ":" not in KILL_AT:
        return "", 0, False, None
    head, pattern = KILL_AT.split(":", 1)
    after = head.endswith("+")
    kind, _, count = head.rstrip("+").partition("*")
    return kind, int(count or 1), after, re.compile(pattern)


KIND, COUNT, AFTER, PATTERN = _kill_spec()
_matched = [0]


def _under_root(path) -> str | None:
    if ROOT is None or isinstance(path, int):
        return None
    try:
        where = os.path.abspath(os.fspath(path))
    except TypeError:
        return None
    return where if where.startswith(ROOT + os.sep) and where != LOG else None


def _change(kind: str, path) -> bool:
    """Count one change of ``path`` (kill or log it) when it lies under the test's folder; whether
    it is the trap's change, to be killed right after."""
    global _count
    where = _under_root(path)
    if where is None:
        return False
    with _lock:
        _count += 1
        if KILL_AT.isdigit() and _count == int(KILL_AT):
            _die()
        if LOG:
            with _orig_open(LOG, "a") as f:
                f.write(f"{_count} {kind} {where}\n")
        if kind != KIND or not PATTERN.search(where):
            return False
        _matched[0] += 1
        if _matched[0] != COUNT:
            return False
        if not AFTER:
            _die()
        return True


def _wrap(module, name: str, kind: str, writes=lambda *a, **k: True) -> None:
    real = getattr(module, name)

    def traced(*args, **kwargs):
        hit = bool(args) and writes(*args, **kwargs) and _change(kind, args[0])
        out = real(*args, **kwargs)
        if hit:
            _die()
        return out

    setattr(module, name, traced)


def _writing_mode(file, mode="r", *args, **kwargs) -> bool:
    return any(c in mode for c in "wax+")


def _writing_flags(path, flags, *args, **kwargs) -> bool:
    return bool(flags & _WRITE_FLAGS)


def install_fs_trap() -> None:
    _wrap(builtins, "open", "open", _writing_mode)
    io.open = builtins.open
    _wrap(os, "open", "open", _writing_flags)
    for name in ("replace", "rename", "link", "symlink", "unlink", "remove", "rmdir", "mkdir"):
        _wrap(os, name, name)


def install_call_trap(spec: str) -> None:
    """SIGKILL at the N-th call of MODULE:QUALNAME (on entry or as it returns)."""
    module_name, qualname, nth, when = spec.split(":")
    owner = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, calls = getattr(owner, attr), [0]

    def trapped(*args, **kwargs):
        calls[0] += 1
        hit = calls[0] == int(nth)
        if hit and when == "enter":
            _die()
        out = real(*args, **kwargs)
        if hit:
            _die()
        return out

    setattr(owner, attr, trapped)


def main() -> int:
    if ROOT is not None:
        install_fs_trap()
    if os.environ.get("APR_TEST_KILL_IN"):
        install_call_trap(os.environ["APR_TEST_KILL_IN"])
    from apr.cli.main import app

    sys.argv = ["apr", *sys.argv[1:]]
    try:
        app()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
