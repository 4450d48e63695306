"""A tiny dataset, base config and sweep files for sweep tests (tests/train/run_helpers.py's data)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402

__all__ = ["make_dataset", "write_config", "tiny_root", "write_sweep"]


def tiny_root(root: Path, **sections) -> Path:
    """``root`` with the run helpers' 96-row dataset and ``cfg.yaml`` (hidden 32, 4 heads, 2 kv heads)."""
    make_dataset(root)
    return write_config(root, **sections)


def write_sweep(root: Path, text: str, name: str = "sweep.yaml") -> Path:
    path = root / name
    path.write_text(text.lstrip("\n"))
    return path
