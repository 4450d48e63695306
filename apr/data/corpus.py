"""Built-in real corpora that need no download: the running Python's standard library source.

``stdlib`` is the ``.py`` files of the standard library (not site-packages, not the test suites,
whose files include deliberately undecodable ones), up to a byte cap. Which files are taken is
decided by a hash of each file's relative path, so the sample spreads over the whole library
rather than stopping at the modules whose names sort first, and is the same on every run with the
same Python. The files are returned sorted by path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from pathlib import Path

from apr.errors import AprError, Finding

BUILTINS = ("stdlib",)
DEFAULT_MAX_BYTES = 4_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "test_asyncio"}


@functools.cache
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_corpus_files(name: str = "stdlib", max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[Path]:
    """The files of built-in corpus ``name``, at most ``max_bytes`` in total, sorted by path."""
    if name not in BUILTINS:
        raise AprError(f"unknown built-in corpus {name!r}", [Finding(
            "error", "data.builtin", f"no built-in corpus named {name!r}", path="--builtin",
            expected=" or ".join(BUILTINS), got=name)])
    root = stdlib_root()
    candidates: list[tuple[bytes, Path, int]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # pruned, not walked: site-packages is large
        for name in names:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue  # _sysconfigdata is generated per machine: the corpus would differ between hosts
            path = Path(folder, name)
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size:
                rel = path.relative_to(root).as_posix()
                candidates.append((hashlib.sha1(rel.encode()).digest(), path, size))
    chosen: list[Path] = []
    total = 0
    for _, path, size in sorted(candidates):
        if max_bytes is not None and total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    if not chosen:
        raise AprError(f"the built-in corpus {name!r} is empty", [Finding(
            "error", "data.builtin", f"no .py files under {root} fit in {max_bytes} bytes", file=str(root))])
    return sorted(chosen)


def source_name(path: Path) -> str:
    """How a file is named in manifest.json: ``stdlib:json/decoder.py`` for the built-in corpus."""
    try:
        return "stdlib:" + path.relative_to(stdlib_root()).as_posix()
    except ValueError:
        return str(path)
