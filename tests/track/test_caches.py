"""The caches under $APR_HOME/cache (apr/track/caches.py): entries grouped by key, sized, dated by
their last use (not by being listed), and pruned whole by age, by a vanished dataset or all; a token
cache being built (its lock held) is never removed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from apr.track import caches

DAY = 86400.0


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _entry(folder: Path, key: str, suffixes: dict[str, bytes], meta: dict, age_days: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    then = time.time() - age_days * DAY
    for suffix, data in {**suffixes, ".json": json.dumps(meta).encode()}.items():
        path = folder / f"{key}{suffix}"
        path.write_bytes(data)
        os.utime(path, (then, then))


def _tokens(home: Path, key: str, source: Path, age_days: float) -> None:
    _entry(home / "cache" / "tokens", key, {".u32": b"\0" * 4000, ".sum": b"s" * 16},
           {"source": str(source), "rows": 10, "row_len": 100}, age_days)


def test_entries_are_grouped_sized_and_dated_and_listing_is_not_a_use(home, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _tokens(home, "a" * 32, data, age_days=40)
    _entry(home / "cache" / "teacher", "7" * 32, {".f32": b"\0" * 9000, ".sum": b"", ".idx": b""},
           {"teacher": "f" * 64, "row_len": 128, "hidden": 64, "boundaries": [0, 1, 2], "rank": 0}, age_days=3)
    (home / "cache" / "inductor" / "fxgraph").mkdir(parents=True)
    (home / "cache" / "inductor" / "fxgraph" / "g1").write_bytes(b"x" * 500)
    (home / "cache" / "tokens" / "notes.txt").write_text("not an entry")
    found = {e.kind: e for e in caches.entries()}
    assert set(found) == {"tokens", "teacher", "inductor"}
    tok, teacher = found["tokens"], found["teacher"]
    assert tok.files == 3 and tok.bytes == 4016 + len(json.dumps({"source": str(data), "rows": 10, "row_len": 100}))
    assert str(data) in tok.what and not tok.source_gone and "3 boundaries" in teacher.what
    assert 39 < (time.time() - tok.last_used) / DAY < 41
    assert found["inductor"].files == 1 and found["inductor"].bytes == 500
    again = {e.kind: e for e in caches.entries()}  # the listing read the .json files: still 40 days
    assert 39 < (time.time() - again["tokens"].last_used) / DAY < 41


def test_prune_by_age_removes_whole_old_entries_only(home, tmp_path):
    _tokens(home, "0" * 32, tmp_path, age_days=40)
    _tokens(home, "1" * 32, tmp_path, age_days=1)
    removed, skipped = caches.prune(caches.entries(("tokens",)), 30 * DAY, dry_run=True)
    assert [e.key for e in removed] == ["0" * 32] and skipped == []
    assert len(list((home / "cache" / "tokens").iterdir())) == 6  # a dry run removes nothing
    caches.prune(caches.entries(("tokens",)), 30 * DAY)
    assert sorted(p.name for p in (home / "cache" / "tokens").iterdir()) == [
        f"{'1' * 32}{s}" for s in (".json", ".sum", ".u32")]


def test_prune_gone_removes_the_entries_of_datasets_that_no_longer_exist(home, tmp_path):
    kept, vanished = tmp_path / "kept", tmp_path / "vanished"
    kept.mkdir()
    _tokens(home, "2" * 32, kept, age_days=0)
    _tokens(home, "3" * 32, vanished, age_days=0)
    removed, _ = caches.prune(caches.entries(), None, gone=True)
    assert [e.key for e in removed] == ["3" * 32] and removed[0].source_gone
    assert [e.key for e in caches.entries()] == ["2" * 32]


def test_a_token_entry_whose_lock_is_held_is_skipped(home, tmp_path):
    fcntl = pytest.importorskip("fcntl")
    _tokens(home, "b" * 32, tmp_path, age_days=50)
    lock = home / "cache" / "tokens" / f"{'b' * 32}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process building it (a second open file: flock is per file)
        removed, skipped = caches.prune(caches.entries(), None)
        assert removed == [] and "being built" in skipped[0][1]
    finally:
        os.close(fd)
    removed, _ = caches.prune(caches.entries(), None)
    assert len(removed) == 1 and not any((home / "cache" / "tokens").iterdir())


def test_a_user_inductor_cache_is_not_aprs(home, tmp_path, monkeypatch):
    mine = tmp_path / "my-inductor"
    (mine / "x").mkdir(parents=True)
    (mine / "x" / "graph").write_bytes(b"1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    assert caches.entries() == []
    caches.prune(caches.entries(), None)
    assert (mine / "x" / "graph").exists()


def test_prune_removes_only_what_aprs_cache_made(home, tmp_path):
    """A file of someone else's in a cache folder (another name, a symlink under an entry's name, a
    folder) is neither listed nor removed, even by --all."""
    data = tmp_path / "data"
    data.mkdir()
    _tokens(home, "a" * 32, data, age_days=40)
    tokens = home / "cache" / "tokens"
    (tokens / "notes.json").write_text('{"source": "mine", "rows": 1, "row_len": 1}')
    (tokens / "my-export.u32").write_bytes(b"\0" * 64)
    precious = tmp_path / "precious.u32"
    precious.write_bytes(b"keep")
    (tokens / f"{'b' * 32}.u32").symlink_to(precious)
    (tokens / f"{'c' * 32}.json").mkdir()
    assert [e.key for e in caches.entries()] == ["a" * 32]
    removed, skipped = caches.prune(caches.entries(), None)
    assert [e.key for e in removed] == ["a" * 32] and skipped == []
    assert sorted(p.name for p in tokens.iterdir()) == [f"{'b' * 32}.u32", f"{'c' * 32}.json", "my-export.u32",
                                                       "notes.json"]
    assert precious.read_bytes() == b"keep"


def test_an_inductor_folder_that_is_a_link_is_not_removed(home, tmp_path):
    theirs = tmp_path / "theirs"
    (theirs / "g").mkdir(parents=True)
    (theirs / "g" / "graph").write_bytes(b"1")
    (home / "cache").mkdir(parents=True)
    (home / "cache" / "inductor").symlink_to(theirs)
    removed, skipped = caches.prune(caches.entries(("inductor",)), None)
    assert removed == [] and skipped and "symlink" in skipped[0][1]
    assert (theirs / "g" / "graph").read_bytes() == b"1"
