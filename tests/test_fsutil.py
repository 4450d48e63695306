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
