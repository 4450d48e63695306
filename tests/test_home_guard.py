"""The suite may not touch the user's real registry (issue 24 item 3), and another apr process
using it while the suite runs may not fail the suite (issue 54 item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent

_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
pytest_plugins = ["home_guard"]
"""

_TESTS = '''
import os
import subprocess
import sys
import time
from pathlib import Path

ENV_AT_IMPORT = dict(os.environ)  # the pattern that once leaked the caller's APR_HOME
WRITE = os.environ.get("WRITE")


def test_import_time_copy_is_private():
    caller = os.environ["CALLER_HOME"]
    assert caller not in [v for k, v in ENV_AT_IMPORT.items() if k != "CALLER_HOME"]
    assert ENV_AT_IMPORT["APR_HOME"] == os.environ["APR_HOME"]
    assert ENV_AT_IMPORT["HOME"] != os.environ["REAL_HOME"]


def test_the_users_files_are_still_there():
    assert (Path.home() / ".config" / "tool.ini").read_text() == "kept"
    assert not (Path.home() / ".apr").exists()


def test_writes_only_where_told():
    if WRITE == "home":
        (Path.home() / ".apr").mkdir(exist_ok=True)
        (Path.home() / ".apr" / "experiments.db").write_text("x")
    elif WRITE == "expanduser":
        target = Path("~/.apr/cache/tokens").expanduser()
        target.mkdir(parents=True)
    elif WRITE == "child":
        env = {k: v for k, v in os.environ.items() if k != "APR_HOME"}
        code = "from pathlib import Path; p = Path.home() / '.apr'; p.mkdir(); (p / 'runs.db').write_text('x')"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)


def test_takes_a_while():
    time.sleep(float(os.environ.get("SLEEP", "0")))
'''


def _run(tmp_path: Path, write: str | None, sleep: float = 0.0) -> subprocess.CompletedProcess:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    (suite / "conftest.py").write_text(_CONFTEST)
    (suite / "test_sample.py").write_text(_TESTS)
    home = tmp_path / "home"
    caller = tmp_path / "caller_home"
    (home / ".apr").mkdir(parents=True, exist_ok=True)
    (home / ".config").mkdir(exist_ok=True)
    (home / ".config" / "tool.ini").write_text("kept")
    caller.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "_APR_GUARD_SESSION"}
    env.update(HOME=str(home), APR_HOME=str(caller), REAL_HOME=str(home), CALLER_HOME=str(caller),
               SLEEP=str(sleep))
    if write:
        env["WRITE"] = write
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(suite)], capture_output=True, text=True, timeout=120, env=env, cwd=suite)


def test_guard_passes_a_clean_suite_and_hides_the_callers_home(tmp_path):
    proc = _run(tmp_path, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "touched the user's apr registry" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == [".apr", ".config"]  # nothing left behind


def _verdict_is_last(stdout: str) -> None:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert "touched the user's apr registry" in lines[-1], stdout
    assert any(" passed" in ln for ln in lines[:-1]), stdout  # every test passed, the suite still fails


def test_guard_fails_a_suite_that_writes_to_home_apr(tmp_path):
    proc = _run(tmp_path, "home")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _verdict_is_last(proc.stdout)
    assert "experiments.db" in proc.stdout.splitlines()[-1]
    assert list((tmp_path / "home" / ".apr").iterdir()) == []  # the real one was never written


def test_guard_catches_expanduser_and_a_child_process_without_apr_home(tmp_path):
    for how, path in (("expanduser", "cache/tokens"), ("child", "runs.db")):
        proc = _run(tmp_path, how)
        assert proc.returncode == 1, how + proc.stdout + proc.stderr
        _verdict_is_last(proc.stdout)
        assert path in proc.stdout.splitlines()[-1]
    assert list((tmp_path / "home" / ".apr").iterdir()) == []


def test_another_process_writing_the_real_registry_does_not_fail_the_suite(tmp_path):
    """A user's `apr train apply` without APR_HOME, or a second checkout's suite, writes ~/.apr and
    the caller's APR_HOME while this suite runs: the guard does not count it."""
    real = tmp_path / "home" / ".apr"
    caller = tmp_path / "caller_home"
    real.mkdir(parents=True)
    caller.mkdir()
    writer_code = (
        "import sys, time, pathlib\n"
        "roots = [pathlib.Path(a) for a in sys.argv[1:]]\n"
        "n = 0\n"
        "while True:\n"
        "    for r in roots:\n"
        "        (r / 'experiments.db').write_text(str(n))\n"
        "        (r / f'run-{n}.json').write_text('{}')\n"
        "    n += 1\n"
        "    time.sleep(0.05)\n")
    writer = subprocess.Popen([sys.executable, "-c", writer_code, str(real), str(caller)])
    try:
        time.sleep(0.3)
        before = len(list(real.glob("run-*.json")))
        proc = _run(tmp_path, None, sleep=1.5)
        during = len(list(real.glob("run-*.json"))) - before
    finally:
        writer.kill()
        writer.wait()
    assert during > 5  # the other process really wrote while the suite ran
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "touched the user's apr registry" not in proc.stdout
