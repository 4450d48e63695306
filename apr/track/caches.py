"""What apr keeps under ``$APR_HOME/cache`` and how to free it (``apr cache ls`` / ``apr cache prune``;
docs/runs.md, "Caches"). Torch-free.

Three caches grow there as runs come and go, and nothing else removes them:

* ``tokens``: the token cache (apr/data/tokencache.py), an entry per dataset version, ``KEY.u32``,
  ``KEY.sum``, ``KEY.json`` (and ``KEY.lock`` while it is built). A new version of a dataset
  replaces its older entries by itself; a dataset no longer used keeps its entry.
* ``teacher``: the teacher output cache (apr/train/teacher_cache.py), an entry per teacher, data
  length and rank, ``KEY.f32``, ``KEY.sum``, ``KEY.idx``, ``KEY.json``: the largest by far (every
  block boundary's hidden states of every row).
* ``inductor``: torch.compile's compiled graphs (apr/train/compile.py), one folder that inductor
  manages; listed and pruned as one entry (only apr's own folder: a ``TORCHINDUCTOR_CACHE_DIR`` the
  user set is left alone).

An entry's "last used" time is the newest access or change of any of its data files (``atime`` as
the file system keeps it, at worst daily under ``relatime``; its ``.json`` by its change time only,
since listing reads it). Pruning removes whole entries; an entry
whose ``.lock`` another process holds (a token cache being built) is skipped. A run that has an
entry open when it is removed keeps reading its files (POSIX keeps an open file until it is closed),
and the space comes back when that run ends.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from apr.track.names import apr_home

KINDS = ("tokens", "teacher", "inductor")
_KEY = re.compile(r"^[0-9a-f]{32}$")  # apr's cache keys: the first 32 hex digits of a SHA-256
SUFFIXES = {"tokens": (".u32", ".sum", ".json", ".lock"), "teacher": (".f32", ".sum", ".idx", ".json")}


@dataclass
class Entry:
    kind: str
    key: str
    path: str  # the entry's folder (inductor) or its files' common prefix
    files: int
    bytes: int
    last_used: float  # seconds since the epoch
    what: str  # what the entry holds, from its metadata where it has one
    source_gone: bool = False  # a token entry whose dataset folder no longer exists

    def to_dict(self) -> dict:
        return asdict(self)


def cache_root() -> Path:
    return apr_home() / "cache"


def folder(kind: str) -> Path:
    """apr's own folder of ``kind`` (a ``TORCHINDUCTOR_CACHE_DIR`` the user set is theirs: not listed
    or pruned here)."""
    return cache_root() / kind


def _stat(path: Path) -> tuple[int, float]:
    """Size and last use. A ``.json`` counts by its change time only: reading it (as listing does)
    moves its access time, and a listing is not a use."""
    st = path.lstat()
    used = st.st_mtime if path.suffix == ".json" else max(st.st_mtime, st.st_atime)
    return (st.st_size if path.is_file() and not path.is_symlink() else 0), used


def _meta(meta: Path) -> dict | None:
    try:
        if not meta.is_file() or meta.stat().st_size > 1 << 20:
            return None
        doc = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: [[[[... nested deeply
        return None
    return doc if isinstance(doc, dict) else None


def _field(doc: dict, key: str, limit: int = 200) -> str:
    """One metadata value for the listing: a number or a short string, else ``?`` (a nested or
    huge value in a damaged file is never printed)."""
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return "?"
    text = str(value) if not isinstance(value, int) or abs(value) < 10**18 else "?"
    return text if len(text) <= limit else text[:limit] + "..."


def _what(kind: str, doc: dict | None) -> str:
    if doc is None:
        return "no readable metadata"
    if kind == "tokens":
        return f"{_field(doc, 'source')} ({_field(doc, 'rows')} rows x {_field(doc, 'row_len')})"
    boundaries = doc.get("boundaries")
    return (f"teacher {_field(doc, 'teacher', 16)}, rows of {_field(doc, 'row_len')} x hidden "
            f"{_field(doc, 'hidden')} at {len(boundaries) if isinstance(boundaries, list) else '?'} boundaries, "
            f"rank {_field(doc, 'rank')}")


def _is_aprs(path: Path, kind: str) -> bool:
    """Whether ``path`` is a file apr's cache made: ``KEY.<suffix>`` with the 32 hex digits of apr's
    keys and one of the kind's suffixes, a regular file (a symlink, folder or FIFO is not). Anything
    else in the folder is someone else's and is neither listed nor removed."""
    stem, dot, suffix = path.name.partition(".")
    return (bool(dot) and f".{suffix}" in SUFFIXES[kind] and _KEY.match(stem) is not None
            and stat.S_ISREG(path.lstat().st_mode))


def _file_entries(kind: str, where: Path) -> list[Entry]:
    groups: dict[str, list[Path]] = {}
    for path in where.iterdir():
        try:
            if _is_aprs(path, kind):
                groups.setdefault(path.name.partition(".")[0], []).append(path)
        except OSError:  # vanished while listed
            continue
    out = []
    for key, files in sorted(groups.items()):
        stats = [_stat(f) for f in files]
        doc = _meta(where / f"{key}.json")
        source = doc.get("source") if doc is not None and kind == "tokens" else None
        gone = isinstance(source, str) and not _exists(source)
        out.append(Entry(kind, key, str(where / key), len(files), sum(s for s, _ in stats),
                         max(t for _, t in stats), _what(kind, doc) + (" (gone)" if gone else ""), gone))
    return out


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):  # a NUL byte, a name too long: not a file the cache came from
        return False


def _tree_entry(kind: str, where: Path) -> list[Entry]:
    files = size = 0
    newest = where.lstat().st_mtime
    for dirpath, _dirs, names in os.walk(where):
        for name in names:
            try:
                s, t = _stat(Path(dirpath) / name)
            except OSError:
                continue
            files, size, newest = files + 1, size + s, max(newest, t)
    if files == 0:
        return []
    return [Entry(kind, kind, str(where), files, size, newest, "torch.compile's compiled graphs")]


def entries(kinds: tuple[str, ...] = KINDS) -> list[Entry]:
    """Every entry of ``kinds``, oldest use first within each kind."""
    out = []
    for kind in kinds:
        where = folder(kind)
        if not where.is_dir():
            continue
        found = _tree_entry(kind, where) if kind == "inductor" else _file_entries(kind, where)
        out += sorted(found, key=lambda e: e.last_used)
    return out


def _locked(lock: Path) -> bool:
    """Whether another process holds ``lock`` (fcntl, as the token cache takes it)."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def prune(found: list[Entry], older_than_s: float | None, dry_run: bool = False, now: float | None = None,
          gone: bool = False) -> tuple[list[Entry], list[tuple[Entry, str]]]:
    """Remove the entries of ``found`` last used more than ``older_than_s`` ago (None: all of them;
    ``gone``: only token entries whose dataset no longer exists, at any age); returns (removed,
    skipped with the reason). ``dry_run``: nothing is removed."""
    now = time.time() if now is None else now
    removed, skipped = [], []
    for e in found:
        if gone and not e.source_gone:
            continue
        if older_than_s is not None and now - e.last_used < older_than_s:
            continue
        if e.kind == "tokens" and _locked(Path(f"{e.path}.lock")):
            skipped.append((e, "being built by another process (its .lock is held)"))
            continue
        if not dry_run:
            try:
                _remove(e)
            except OSError as err:
                skipped.append((e, f"{type(err).__name__}: {err.strerror or err}"))
                continue
        removed.append(e)
    return removed, skipped


def _remove(e: Entry) -> None:
    if e.kind == "inductor":
        if os.path.islink(e.path):  # apr's folder replaced by a link to someone's: not removed
            raise OSError(errno.ENOTDIR, "a symlink, not apr's folder")
        shutil.rmtree(e.path)
        return
    for suffix in SUFFIXES[e.kind]:
        path = Path(f"{e.path}{suffix}")
        if path.exists() and _is_aprs(path, e.kind):  # checked again at removal: only apr's own files
            path.unlink()
