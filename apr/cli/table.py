"""Plain left-aligned text tables for `apr runs ls` and `apr experiment view --params`."""

from __future__ import annotations


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)
