"""The one atomic write (apr/fsutil.py) every writer uses: checkpoints, exports, plan files, state."""

from __future__ import annotations

import os

import pytest

from apr.fsutil import atomic_open, atomic_path, atomic_write_bytes


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def _plain_mode(folder) -> int:
    with open(folder / "plain", "wb"):
        pass
    return (folder / "plain").stat().st_mode & 0o777


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path, umask_027):
    atomic_write_bytes(tmp_path / "a.bin", b"x")
    with atomic_path(tmp_path / "b.bin") as tmp:
        tmp.write_bytes(b"y")
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == _plain_mode(tmp_path) == 0o640
    assert (tmp_path / "b.bin").stat().st_mode & 0o777 == 0o640


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_open(target) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk gone")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_path_writer_replaces_the_file_only_at_the_end(tmp_path):
    target = tmp_path / "m.csv"
    target.write_text("old")
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"  # readers see the old file until the rename
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.csv"]


# ------------------------------------------------------------------ the checked output writer

import subprocess  # noqa: E402
import sys  # noqa: E402

from apr.errors import AprError  # noqa: E402
from apr.fsutil import apr_record_kind, check_output_file, write_output  # noqa: E402


def test_write_output_replaces_only_with_overwrite_and_names_the_option(tmp_path):
    target = tmp_path / "ledger.csv"
    write_output(target, "a\n", option="--output")
    with pytest.raises(AprError) as err:
        write_output(target, "b\n", option="--output")
    assert "--output" in err.value.message and "--overwrite" in err.value.message
    assert target.read_text() == "a\n"
    write_output(target, "b\n", overwrite=True, option="--output")
    assert target.read_text() == "b\n"


def test_apr_records_are_refused_even_with_overwrite(tmp_path):
    store = tmp_path / "home" / "experiments.db"
    run = tmp_path / "run"
    (run / ".apr").mkdir(parents=True)
    (run / "training_state.json").write_text("{}")
    (run / "plan.json").write_text("{}")
    store.parent.mkdir()
    store.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    for path in (store, run / "training_state.json", run / "plan.json", run / ".apr" / "anything.json",
                 run / "checkpoint-step-3.json"):
        assert apr_record_kind(path) is not None, path
        with pytest.raises(AprError):
            check_output_file(path, overwrite=True)
    # the same names outside a run folder are ordinary outputs, also beside an APR_HOME (~/.apr)
    assert apr_record_kind(tmp_path / "plan.json") is None
    (tmp_path / ".apr").mkdir()
    (tmp_path / ".apr" / "experiments.db").write_bytes(b"")
    assert apr_record_kind(tmp_path / "config.yaml") is None


def test_a_sqlite_file_under_any_name_is_never_replaced(tmp_path):
    db = tmp_path / "metrics.csv"
    db.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
    with pytest.raises(AprError) as err:
        check_output_file(db, overwrite=True)
    assert "SQLite" in err.value.message


@pytest.mark.parametrize("make", ["under_a_file", "too_long", "empty"])
def test_odd_output_paths_are_errors_naming_the_option(tmp_path, make):
    (tmp_path / "file").write_text("x")
    path = {"under_a_file": tmp_path / "file" / "out.json", "too_long": tmp_path / ("n" * 300),
            "empty": ""}[make]
    with pytest.raises(AprError) as err:
        write_output(path, "{}", option="--json-out")
    assert "--json-out" in err.value.message
    assert (tmp_path / "file").read_text() == "x"


def test_a_read_only_folder_is_an_error_and_the_old_file_stays(tmp_path):
    import shutil

    target = tmp_path / "ro" / "out.txt"
    target.parent.mkdir()
    target.write_text("old")
    target.parent.chmod(0o555)
    root = os.geteuid() == 0  # root writes through mode bits: make the folder immutable instead
    if root and (not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(target.parent)],
                                                               capture_output=True).returncode != 0):
        target.parent.chmod(0o755)
        pytest.skip("running as root without chattr: cannot make a folder read-only")
    try:
        with pytest.raises(AprError) as err:
            write_output(target, "new", overwrite=True, option="--out")
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(target.parent)], check=False)
        target.parent.chmod(0o755)
    assert "--out" in err.value.message and target.read_text() == "old"


def test_a_file_size_limit_is_an_error_and_the_old_file_stays(tmp_path):
    """EFBIG, as a full quota or a small RLIMIT_FSIZE gives it: simulated in a subprocess."""
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "from apr.errors import AprError\n"
        "from apr.fsutil import write_output\n"
        "try:\n"
        f"    write_output({str(target)!r}, b'x' * 100000, overwrite=True, option='--out')\n"
        "except AprError as e:\n"
        "    print(e.message); sys.exit(1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "--out" in done.stdout and "File too large" in done.stdout and "Traceback" not in done.stderr
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]  # no temp file left
