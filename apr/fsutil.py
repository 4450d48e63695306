"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

Readers never see a torn file; a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        make_ordinary(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
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


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, obj: Any, fsync: bool = True, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str, allow_nan=False) + "\n", fsync=fsync)
