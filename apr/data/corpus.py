"""Built-in real corpora that need no download: the running Python's standard library source."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from apr.errors import AprError

BUILTINS = ("stdlib",)


def builtin_corpus_files(name: str = "stdlib", max_bytes: int | None = 8_000_000) -> list[Path]:
    """The ``.py`` files of the standard library in a stable order, up to ``max_bytes`` in total."""
    if name not in BUILTINS:
        raise AprError(f"unknown built-in corpus {name!r}; available: {', '.join(BUILTINS)}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages") or "__pycache__" in rel:
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size == 0:
            continue
        if max_bytes is not None and total + size > max_bytes:
            continue
        files.append(path)
        total += size
    if not files:
        raise AprError(f"the built-in corpus {name!r} is empty under {root}")
    return files
