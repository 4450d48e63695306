"""Locate the data folders shipped with apr (contracts/, kernels/, configs/).

In a checkout they sit beside the package; in an installed wheel they are
packed under ``apr/_data/`` (see pyproject's force-include).
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """Return the folder ``name`` (``contracts``, ``kernels`` or ``configs``)."""
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"apr resource folder {name!r} not found beside {_PKG}")
