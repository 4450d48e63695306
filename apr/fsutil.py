"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

Readers never see a torn file; a crash leaves either the old file or the new one.
"""

from __future__ import annotations

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


def check_output_file(out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                      overwrite: bool = False, option: str = "--out") -> Path:
    """Refuse an output file apr must not write: one that exists and is not a regular file (a
    device such as /dev/null, a FIFO, a folder, a symlink; an atomic write would replace it with a
    file), one that is one of the command's own ``inputs``, or one that
    exists without ``overwrite``. Every command that writes a file calls this before any work."""
    path = Path(out)
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise _output_error(path, option, f"cannot inspect {option} {path}: {e.strerror or e}",
                            "a path apr can write", "an unreadable path") from None
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
    if st is not None and not overwrite:
        raise _output_error(path, option, f"{option} {path} already exists; pass --overwrite to replace it",
                            "a new path, or --overwrite", "an existing file")
    return path


def _output_error(path: Path, option: str, message: str, expected: str, got: str) -> AprError:
    return AprError(message, [Finding("error", "output.refused", message, path=option, file=str(path),
                                      expected=expected, got=got)])
