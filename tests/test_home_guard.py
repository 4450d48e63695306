"""The suite may not touch the user's real registry (issue 24 item 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
pytest_plugins = ["home_guard"]
"""

_TESTS = '''
import os
from pathlib import Path

ENV_AT_IMPORT = dict(os.environ)  # the pattern that once leaked the caller's APR_HOME


def test_import_time_copy_is_private():
    assert ENV_AT_IMPORT["APR_HOME"] != os.environ["_APR_GUARD_CALLER_HOME"]


def test_writes_only_where_told():
    target = Path(os.environ["WRITE_TO"]) if os.environ.get("WRITE_TO") else None
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        (target / "experiments.db").write_text("x")
'''


def _run(tmp_path: Path, write_to: str | None) -> subprocess.CompletedProcess:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    (suite / "conftest.py").write_text(_CONFTEST)
    (suite / "test_sample.py").write_text(_TESTS)
    home = tmp_path / "home"
    caller = tmp_path / "caller_home"
    (home / ".apr").mkdir(parents=True, exist_ok=True)
    caller.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "_APR_GUARD_CALLER_HOME"}
    env.update(HOME=str(home), APR_HOME=str(caller))
    if write_to:
        env["WRITE_TO"] = {"home": str(home / ".apr"), "caller": str(caller)}[write_to]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(suite)], capture_output=True, text=True, timeout=120, env=env, cwd=suite)


def test_guard_passes_a_clean_suite_and_hides_the_callers_home(tmp_path):
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_guard_fails_a_suite_that_writes_to_home_apr(tmp_path):
    proc = _run(tmp_path, "home")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "touched the user's apr registry" in proc.stdout


def test_guard_fails_a_suite_that_writes_to_the_callers_apr_home(tmp_path):
    proc = _run(tmp_path, "caller")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert str(tmp_path / "caller_home") in proc.stdout
