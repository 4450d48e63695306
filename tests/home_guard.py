"""A pytest plugin that keeps the suite out of the user's real registry, and fails it if it tries.

At configure time (before any test module is imported, so a module that copies ``os.environ``
at import gets the private values too) the first pytest process (under xdist: the controller,
whose environment the workers inherit) makes a session folder and points two variables into it:

- ``APR_HOME`` at ``<session>/apr-home`` (each test then gets its own, tests/conftest.py), so the
  caller's ``APR_HOME`` is never seen by the suite;
- ``HOME`` at ``<session>/home``, a copy of the user's home made of symlinks to each of its
  entries except ``.apr``. Tools keep their configuration and caches (pip, git, Chromium...), but
  ``~/.apr`` as any of the suite's processes resolves it (``Path.home()``, ``expanduser``) is a
  folder only the suite can write.

The verdict is what the suite itself wrote: any file or folder in ``<session>/home/.apr`` at the
end fails the run (exit 1), however many tests passed. The real ``~/.apr`` and the caller's
``APR_HOME`` are not compared: another apr process on the machine (a user's run, another checkout's
suite) writes there while the suite runs, and that is none of the suite's business (issue 54 item
6). The verdict is printed last, after pytest's summary line, where it is seen."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION_KEY = "_APR_GUARD_SESSION"
_VERDICT = "the test suite touched the user's apr registry (~/.apr)"


def _private_home(real: Path, session: Path) -> Path:
    home = session / "home"
    home.mkdir()
    try:
        entries = list(os.scandir(real))
    except OSError:
        entries = []
    for entry in entries:
        if entry.name != ".apr":
            os.symlink(entry.path, home / entry.name)
    return home


def pytest_configure(config):
    if _SESSION_KEY not in os.environ:
        session = Path(tempfile.mkdtemp(prefix="apr-test-session-"))
        os.environ[_SESSION_KEY] = str(session)
        os.environ["HOME"] = str(_private_home(Path.home(), session))
        (session / "apr-home").mkdir()
        os.environ["APR_HOME"] = str(session / "apr-home")
        config._apr_guard_session = session
    # inductor's compile cache: one for every session, as before apr kept it under APR_HOME (each
    # test's own): compiled tests stay warm across tests and runs
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "apr-test-inductor"))


def pytest_sessionstart(session):
    session.config._apr_guard_pytest_session = session


def suite_writes(home_apr: Path) -> list[str]:
    """What the suite's processes wrote into ``~/.apr`` (their private one), relative paths."""
    if not home_apr.exists() and not home_apr.is_symlink():
        return []
    if not home_apr.is_dir() or home_apr.is_symlink():
        return ["."]
    out = []
    for dirpath, dirnames, filenames in os.walk(home_apr):
        for name in dirnames + filenames:
            out.append(str((Path(dirpath) / name).relative_to(home_apr)))
    return sorted(out) or ["."]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Only the process that made the session folder judges and removes it (under xdist: the
    # controller, after every worker has finished). Unconfigure runs after the terminal summary.
    made = getattr(config, "_apr_guard_session", None)
    if made is None:
        return
    try:
        written = suite_writes(made / "home" / ".apr")
        if written:
            shown = ", ".join(written[:5]) + (f" and {len(written) - 5} more" if len(written) > 5 else "")
            msg = f"ERROR: {_VERDICT}: {shown}. A test or a command it ran ignored APR_HOME."
            reporter = config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(msg, red=True, bold=True)
            else:
                print(msg, flush=True)
            session = getattr(config, "_apr_guard_pytest_session", None)
            if session is not None and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        shutil.rmtree(made, ignore_errors=True)
