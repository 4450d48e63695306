"""Pictures of weights, updates and attention: text for the terminal, SVG and PNG for files.

Written by hand rather than through matplotlib (docs/design.md, "Inspecting checkpoints"): the
pictures are bars and coloured cells, which SVG rects and a raw PNG scanline encoder draw in a
few lines with no extra dependency, and the files come out byte-identical run to run.
"""

from __future__ import annotations

import math
import struct
import zlib
from html import escape

SPARK = " ▁▂▃▄▅▆▇█"
SHADE = " ░▒▓█"
# a perceptual dark-to-light ramp (viridis' endpoints and midpoints), interpolated linearly
_RAMP = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def colour(v: float) -> tuple[int, int, int]:
    v = min(max(v, 0.0), 1.0) * (len(_RAMP) - 1)
    i = min(int(v), len(_RAMP) - 2)
    t = v - i
    return tuple(round(a + (b - a) * t) for a, b in zip(_RAMP[i], _RAMP[i + 1], strict=True))


def sparkline(counts: list[int]) -> str:
    """One character per bin, its height the bin's share of the largest (a non-empty bin never blank)."""
    top = max(counts) if counts else 0
    if top == 0:
        return " " * len(counts)
    return "".join(SPARK[0] if c == 0 else SPARK[max(1, round(8 * c / top))] for c in counts)


def pool(matrix: list[list[float]], size: int) -> list[list[float]]:
    """Shrink a square matrix to at most ``size`` x ``size`` by taking each block's maximum (a
    sharp attention peak stays visible)."""
    n = len(matrix)
    if n <= size:
        return matrix
    edges = [round(i * n / size) for i in range(size + 1)]
    return [[max(matrix[r][c] for r in range(edges[i], edges[i + 1]) for c in range(edges[j], edges[j + 1]))
             for j in range(size)] for i in range(size)]


def by_row(matrix: list[list[float]]) -> list[list[float]]:
    """Each row scaled to its own maximum: attention rows sum to 1, so a late query spread over
    many keys would otherwise fade next to the first, which has one key to give everything to."""
    return [[v / (max(row) or 1.0) for v in row] for row in matrix]


def shade_map(matrix: list[list[float]], size: int = 48) -> list[str]:
    """Two characters per cell (terminal cells are about twice as tall as wide)."""
    return ["".join(SHADE[round((len(SHADE) - 1) * v)] * 2 for v in row) for row in by_row(pool(matrix, size))]


def finite_or_zero(v: float | None) -> float:
    """A bar's length: a missing or non-finite value draws none (its number is still printed)."""
    return v if v is not None and math.isfinite(v) else 0.0


def text_bars(labels: list[str], values: list[float], width: int = 40, fmt=lambda v: f"{v:.3g}") -> list[str]:
    top = max((finite_or_zero(v) for v in values), default=0.0) or 1.0
    pad = max((len(s) for s in labels), default=0)
    return [f"{label.ljust(pad)}  {'█' * round(width * finite_or_zero(v) / top):<{width}}  "
            f"{fmt(v) if v is not None else '-'}" for label, v in zip(labels, values, strict=True)]


# --------------------------------------------------------------------------------------- SVG


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">\n'
            f'<rect width="{width}" height="{height}" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")


def svg_histograms(rows: list[tuple[str, list[int], float, float]], bar: int = 6, height: int = 40) -> str:
    """Small multiples: one histogram per (label, counts, low, high), stacked."""
    bins = max((len(c) for _, c, _, _ in rows), default=1)
    width, body = 150 + bins * bar + 10, []
    for k, (label, counts, low, high) in enumerate(rows):
        y0, top = k * (height + 14) + 10, max(counts) if counts and max(counts) else 1
        body.append(f'<text x="4" y="{y0 + height // 2}">{escape(label)}</text>')
        body.append(f'<text x="4" y="{y0 + height // 2 + 12}" fill="#666">{low:.3g} .. {high:.3g}</text>')
        for i, c in enumerate(counts):
            h = round(height * c / top)
            body.append(f'<rect x="{150 + i * bar}" y="{y0 + height - h}" width="{bar - 1}" height="{h}" '
                        'fill="#3b528b"/>')
    return _svg(width, len(rows) * (height + 14) + 20, body)


def svg_bars(labels: list[str], values: list[float], title: str) -> str:
    top = max((finite_or_zero(v) for v in values), default=0.0) or 1.0
    body = [f'<text x="4" y="14">{escape(title)}</text>']
    for k, (label, v) in enumerate(zip(labels, values, strict=True)):
        y, w = 24 + k * 16, round(300 * finite_or_zero(v) / top)
        body.append(f'<text x="4" y="{y + 11}">{escape(label)}</text>')
        body.append(f'<rect x="130" y="{y}" width="{w}" height="12" fill="#21918c"/>')
        body.append(f'<text x="{136 + w}" y="{y + 11}">{"-" if v is None else f"{v:.3g}"}</text>')
    return _svg(520, 32 + 16 * len(labels), body)


def svg_heatmap(matrix: list[list[float]], labels: list[str], title: str, cell: int = 12) -> str:
    """Cells coloured by ``by_row``; each cell's hover title is its weight."""
    n, margin = len(matrix), 90
    body = [f'<text x="4" y="14">{escape(title)}</text>']
    for i, (row, scaled) in enumerate(zip(matrix, by_row(matrix), strict=True)):
        for j, (v, s) in enumerate(zip(row, scaled, strict=True)):
            r, g, b = colour(s)
            body.append(f'<rect x="{margin + j * cell}" y="{24 + i * cell}" width="{cell}" height="{cell}" '
                        f'fill="rgb({r},{g},{b})"><title>{v:.4f}</title></rect>')
    if n <= 64:  # beyond that the labels overlap; the hover titles still give each cell's weight
        for i, label in enumerate(labels):
            body.append(f'<text x="{margin - 4}" y="{24 + i * cell + cell - 2}" text-anchor="end">'
                        f'{escape(label[:12].replace(chr(10), "⏎"))}</text>')
    return _svg(margin + n * cell + 10, 34 + n * cell, body)


# --------------------------------------------------------------------------------------- PNG


def png(pixels: list[list[tuple[int, int, int]]]) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` rows (every row the same length)."""
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def png_heatmap(matrix: list[list[float]], cell: int = 8) -> bytes:
    rows = []
    for row in by_row(matrix):
        line = [colour(v) for v in row for _ in range(cell)]
        rows += [line] * cell
    return png(rows)


def png_bars(columns: list[list[int]], height: int = 40, bar: int = 4) -> bytes:
    """Stacked strips of bars: one strip per list of counts (a layer's histogram, or one strip of
    per-layer values), dark bars on white, a grey rule between strips."""
    width = max(len(c) for c in columns) * bar
    rows: list[list[tuple[int, int, int]]] = []
    for counts in columns:
        top = max(counts) if counts and max(counts) else 1
        heights = [round(height * c / top) for c in counts]
        for y in range(height):
            rows.append([(59, 82, 139) if x // bar < len(heights) and height - y <= heights[x // bar] and x % bar
                         else (255, 255, 255) for x in range(width)])
        rows.append([(200, 200, 200)] * width)
    return png(rows)
