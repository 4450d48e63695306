"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

Readers never see a torn file; a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from apr.errors import AprError, Finding


def fsync_dir(folder: str | os.PathLike) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_ordinary(fd_or_path: int | str | os.PathLike, directory: bool = False) -> None:
    """Give a temp file (0600) or temp folder (0700) the mode an ordinary ``open``/``mkdir`` would:
    0666 / 0777 less the umask, so results are as readable as any other file the user writes."""
    mode = (0o777 if directory else 0o666) & ~current_umask()
    if isinstance(fd_or_path, int):
        os.fchmod(fd_or_path, mode)
    else:
        os.chmod(fd_or_path, mode)


@contextmanager
def atomic_path(path: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path beside ``path`` (ordinary mode) for a writer that wants a file name (pyarrow,
    a library's ``save``); when the block ends cleanly the temp file is fsynced and renamed over
    ``path`` and the folder fsynced; on any error it is removed and ``path`` is untouched."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        make_ordinary(fd)
        os.close(fd)
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(path.parent)


@contextmanager
def atomic_open(path: str | os.PathLike, fsync: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file to write ``path``'s new content into, with the guarantees of
    :func:`atomic_path`: the one atomic write every apr writer uses (see docs/design.md)."""
    with atomic_path(path, fsync=fsync) as tmp, open(tmp, "wb") as f:
        yield f
        f.flush()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    with atomic_open(path, fsync=fsync) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, obj: Any, fsync: bool = True, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str, allow_nan=False) + "\n", fsync=fsync)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


# apr's own records, refused as an output of any command (even with --overwrite): the experiment
# stores and their SQLite side files, anything under a run's ``.apr/`` folder, a run's lock, and the
# records of a run folder (a folder holding a training_state.json or a lock).
STORE_NAMES = frozenset({"experiments.db", "experiments.db-wal", "experiments.db-shm", "experiments.db-journal"})
RUN_RECORD_NAMES = frozenset({"training_state.json", "config.yaml", "plan.json", ".apr-run.lock"})
SQLITE_MAGIC = b"SQLite format 3\x00"


def is_sqlite_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file that starts with SQLite's header (read without following
    a FIFO or a device: the caller has checked it is a regular file)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def is_apr_store(path: str | os.PathLike, unreadable: bool = False) -> bool:
    """Whether ``path`` is an apr experiment store (SQLite holding apr's ``schema_version`` and
    ``runs`` tables), whatever its name. ``unreadable``: the answer for a SQLite file that cannot be
    read as one (check_output_file refuses any SQLite file anyway; a sink target is refused then)."""
    if not Path(path).is_file() or not is_sqlite_file(path):
        return False
    import sqlite3  # lazy: sqlite3 stays off validate's import path (tests/test_lazy_imports.py)
    from urllib.parse import quote  # lazy: with sqlite3

    try:
        conn = sqlite3.connect(f"file:{quote(str(Path(path).resolve()))}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return unreadable
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        return {"schema_version", "runs"} <= names
    except sqlite3.Error:
        return unreadable
    finally:
        conn.close()


def apr_record_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` is to apr if it is one of apr's own records (a store, a run's record file, a
    checkpoint), else None. Such files are never a command's output."""
    p = Path(os.path.abspath(path))
    if p.name in STORE_NAMES:
        return "an apr experiment store"
    if ".apr" in p.parts[:-1]:
        return "a file of a run's .apr/ records"
    folder = p.parent
    # a run's folder holds its lock or its state (not merely a .apr/ folder: ~ holds APR_HOME's ~/.apr)
    run_folder = any(os.path.lexists(folder / n) for n in ("training_state.json", ".apr-run.lock"))
    if p.name.startswith("checkpoint-") and p.suffix in (".json", ".safetensors") and (
            run_folder or os.path.lexists(p)):
        return "a checkpoint file"
    if p.name in RUN_RECORD_NAMES and run_folder:
        return f"the {p.name} record of the run in {folder}"
    return None


def check_output_file(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                      overwrite: bool = False, option: str = "--out", sqlite_ok: bool = False) -> Path:
    """Refuse an output file apr must not write: one that exists and is not a regular file (a
    device such as /dev/null, a FIFO, a folder, a symlink; an atomic write would replace it with a
    file), one that is one of the command's own ``inputs``, one of apr's own records (a store, a
    run's record, a checkpoint; :func:`apr_record_kind`), an existing SQLite database (unless
    ``sqlite_ok``: the MLflow export writes into one, never into apr's store), a path under a file,
    or one that exists without ``overwrite``. Every command that writes a file calls this before
    any work, and :func:`write_output` calls it again just before the write."""
    path = Path(out)
    st = _lstat_output(out, option, "a file path", "a path apr can write")
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
                else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise _output_error(path, option, f"{option} {path} is {kind}; apr writes only regular files",
                            "a regular file or a new path", kind)
    for given in inputs:
        source = Path(given)
        if not source.exists():
            continue
        if st is not None and _same_file(path, source):
            raise _output_error(path, option, f"{option} {path} is an input of this command ({source}); "
                                "writing it would destroy the input", "a path that is not an input",
                                f"the input {source}")
    record = apr_record_kind(path)
    if record is None and st is not None and is_apr_store(path):
        record = "an apr experiment store"
    if record is not None:
        raise _output_error(path, option, f"{option} {path} is {record}; apr never writes a command's output "
                            "over its own records", "a path outside apr's records", record)
    if st is not None and not sqlite_ok and is_sqlite_file(path):
        raise _output_error(path, option, f"{option} {path} is a SQLite database; apr will not replace a "
                            "database with this output", "a new path or a file of this output's kind",
                            "a SQLite database")
    if st is not None and not overwrite:
        raise _output_error(path, option, f"{option} {path} already exists; pass --overwrite to replace it",
                            "a new path, or --overwrite", "an existing file")
    return path


def _lstat_output(out: str | os.PathLike, option: str, what: str, writable: str) -> os.stat_result | None:
    """The output target's own stat (None: it does not exist yet, and its folder was checked); an
    empty or unusable path is an error naming the option."""
    path = Path(out)
    if not str(out).strip():
        raise _output_error(path, option, f"{option} is empty", what, "an empty string")
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise _output_error(path, option, f"cannot use {option} {path}: {e.strerror or e}", writable,
                            _errno_name(e)) from None
    if st is None:
        _check_parent(path, option)
    return st


def check_output_folder(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                        option: str = "--out") -> Path:
    """Refuse an output folder apr must not write into: one that exists and is not a folder (a file,
    a FIFO, a device, a symlink), a path under a file, apr's own records (a run's ``.apr/``, an
    APR_HOME), or one of the command's ``inputs``. Whether an
    existing folder may be reused is the command's own rule (``--overwrite``)."""
    path = Path(out)
    st = _lstat_output(out, option, "a folder path", "a folder apr can write")
    if st is not None and not stat.S_ISDIR(st.st_mode):
        kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a file" if stat.S_ISREG(st.st_mode) else "not a folder")
        raise _output_error(path, option, f"{option} {path} is {kind}; expected a folder",
                            "a folder or a new path", kind)
    absolute = Path(os.path.abspath(path))
    if ".apr" in absolute.parts or (st is not None and (path / "experiments.db").exists()):
        raise _output_error(path, option, f"{option} {path} is inside apr's own records; choose another folder",
                            "a folder outside apr's records", "apr's records")
    for given in inputs:
        source = Path(os.path.abspath(given))
        if source == absolute:
            raise _output_error(path, option, f"{option} {path} is an input of this command ({given})",
                                "a folder that is not an input", f"the input {given}")
    return path


def _check_parent(path: Path, option: str) -> None:
    """A new output's folder: the nearest existing ancestor must be a folder (not a file, a FIFO)."""
    for parent in path.absolute().parents:
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise _output_error(path, option, f"cannot use {option} {path}: {parent}: {e.strerror or e}",
                                "a path in a folder apr can write", _errno_name(e)) from None
        if not stat.S_ISDIR(st.st_mode):
            raise _output_error(path, option, f"{option} {path} lies under {parent}, which is not a folder",
                                "a path in a folder", "a path under a file")
        return


def probe_writable(path: str | os.PathLike, option: str) -> None:
    """Before long work whose result goes to ``path``: create its folder and a temp file there (removed
    at once), so a read-only or immutable folder, a full disk or a bad name is an error now, naming
    ``option``, not after the work."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:64]}.", suffix=".probe", dir=target.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise output_write_error(target, option, err) from None


def _errno_name(err: OSError) -> str:
    return errno.errorcode.get(err.errno or 0, type(err).__name__)


def output_write_error(path: str | os.PathLike, option: str, err: OSError) -> AprError:
    """An OSError writing an output (read-only folder, disk full, file too large, name too long), as
    the AprError that names the option and the path; the atomic write has left the old file as it was."""
    message = f"cannot write {option} {path}: {err.strerror or err}; nothing was replaced"
    return _output_error(Path(path), option, message, "a path apr can write", _errno_name(err))


def write_output(path: str | os.PathLike, data: bytes | str, *, inputs: Iterable[str | os.PathLike] = (),
                 overwrite: bool = False, option: str = "--out", make_parents: bool = True) -> Path:
    """The one checked write of a command's output file: :func:`check_output_file`, then an atomic
    write (parents created). OSErrors (EFBIG, ENOSPC, EROFS, ...) become an AprError naming ``option``;
    the target is untouched on any failure."""
    target = check_output_file(path, inputs=inputs, overwrite=overwrite, option=option)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if make_parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, payload)
    except OSError as err:
        raise output_write_error(target, option, err) from None
    return target


@contextmanager
def output_path(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False,
                option: str = "--out") -> Iterator[Path]:
    """:func:`write_output` for a writer that wants a file name (pyarrow): yields the temp path."""
    target = check_output_file(path, inputs=inputs, overwrite=overwrite, option=option)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            yield tmp
    except OSError as err:
        raise output_write_error(target, option, err) from None


def _output_error(path: Path, option: str, message: str, expected: str, got: str) -> AprError:
    return AprError(message, [Finding("error", "output.refused", message, path=option, file=str(path),
                                      expected=expected, got=got)])
