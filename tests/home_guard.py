"""A pytest plugin that keeps the suite out of the user's real registry.

At configure time (before any test module is imported, so a module that copies ``os.environ``
at import gets the private value too) it points ``APR_HOME`` at a session folder, and records
a listing (path, size, mtime) of ``~/.apr`` and of the caller's ``$APR_HOME``. At session end
it fails the run if either listing changed. Under xdist the controller and each worker run it;
the controller's check runs after every worker has finished."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_GUARDED_KEY = "_APR_GUARD_CALLER_HOME"


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    if not root.exists():
        return {}
    if root.is_file():
        st = root.stat()
        return {str(root): (st.st_size, st.st_mtime_ns)}
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
            except OSError:
                continue
            out[str(p)] = (st.st_size, st.st_mtime_ns)
    st = root.stat()
    out[str(root)] = (0, st.st_mtime_ns)
    return out


def guarded_homes() -> list[Path]:
    homes = [Path.home() / ".apr"]
    caller = os.environ.get(_GUARDED_KEY)
    if caller:
        homes.append(Path(caller).expanduser())
    seen, out = set(), []
    for h in homes:
        key = str(h.resolve()) if h.exists() else str(h)
        if key not in seen:
            seen.add(key)
            out.append(h)
    return out


def pytest_configure(config):
    # The first process (controller) records the caller's APR_HOME; xdist workers inherit it.
    if _GUARDED_KEY not in os.environ:
        os.environ[_GUARDED_KEY] = os.environ.get("APR_HOME", "")
        os.environ["APR_HOME"] = tempfile.mkdtemp(prefix="apr-test-home-")
        config._apr_session_home = os.environ["APR_HOME"]
    # inductor's compile cache: one for every session, as before apr kept it under APR_HOME (each
    # test's own): compiled tests stay warm across tests and runs
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "apr-test-inductor"))
    config._apr_home_snapshot = {str(h): _listing(h) for h in guarded_homes()}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    try:
        _check_homes(session)
    finally:
        # Only the process that made the session home removes it (under xdist: the controller,
        # after every worker has finished).
        made = getattr(session.config, "_apr_session_home", None)
        if made:
            shutil.rmtree(made, ignore_errors=True)


def _check_homes(session):
    before = getattr(session.config, "_apr_home_snapshot", None)
    if before is None:
        return
    changed = []
    for home, listing in before.items():
        now = _listing(Path(home))
        if now != listing:
            diff = sorted(set(now.items()) ^ set(listing.items()))
            changed.append(f"{home}: {', '.join(sorted({p for p, _ in diff})[:5])}")
    if changed:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = "the test suite touched the user's apr registry: " + "; ".join(changed)
        if reporter is not None:
            reporter.write_line(f"ERROR: {msg}", red=True)
        else:
            print(f"ERROR: {msg}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
