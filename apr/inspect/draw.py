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

# A 3x5 pixel font (drawn for apr, capitals only: lower case is shown in capitals), enough for the
# labels, numbers and titles of the pictures; a character it lacks is drawn as "?". Each glyph is five
# rows of three pixels, "#" set.
_FONT_ROWS = {
    "0": "### #.# #.# #.# ###", "1": ".#. ##. .#. .#. ###", "2": "### ..# ### #.. ###", "3": "### ..# .## ..# ###",
    "4": "#.# #.# ### ..# ..#", "5": "### #.. ### ..# ###", "6": "### #.. ### #.# ###", "7": "### ..# ..# .#. .#.",
    "8": "### #.# ### #.# ###", "9": "### #.# ### ..# ###", "A": ".#. #.# ### #.# #.#", "B": "##. #.# ##. #.# ##.",
    "C": ".## #.. #.. #.. .##", "D": "##. #.# #.# #.# ##.", "E": "### #.. ##. #.. ###", "F": "### #.. ##. #.. #..",
    "G": ".## #.. #.# #.# .##", "H": "#.# #.# ### #.# #.#", "I": "### .#. .#. .#. ###", "J": "..# ..# ..# #.# .#.",
    "K": "#.# #.# ##. #.# #.#", "L": "#.. #.. #.. #.. ###", "M": "#.# ### ### #.# #.#", "N": "##. #.# #.# #.# #.#",
    "O": ".#. #.# #.# #.# .#.", "P": "##. #.# ##. #.. #..", "Q": ".#. #.# #.# ##. .##", "R": "##. #.# ##. #.# #.#",
    "S": ".## #.. .#. ..# ##.", "T": "### .#. .#. .#. .#.", "U": "#.# #.# #.# #.# ###", "V": "#.# #.# #.# #.# .#.",
    "W": "#.# #.# ### ### #.#", "X": "#.# #.# .#. #.# #.#", "Y": "#.# #.# .#. .#. .#.", "Z": "### ..# .#. #.. ###",
    " ": "... ... ... ... ...", ".": "... ... ... ... .#.", ",": "... ... ... .#. #..", ":": "... .#. ... .#. ...",
    "-": "... ... ### ... ...", "+": "... .#. ### .#. ...", "=": "... ### ... ### ...", "_": "... ... ... ... ###",
    "/": "..# ..# .#. #.. #..", "|": ".#. .#. .#. .#. .#.", "(": "..# .#. .#. .#. ..#", ")": "#.. .#. .#. .#. #..",
    "[": "##. #.. #.. #.. ##.", "]": ".## ..# ..# ..# .##", "<": "..# .#. #.. .#. ..#", ">": "#.. .#. ..# .#. #..",
    "%": "#.# ..# .#. #.. #.#", "'": ".#. .#. ... ... ...", "*": "#.# .#. #.# ... ...", "?": "### ..# .#. ... .#.",
    "#": "#.# ### #.# ### #.#", "!": ".#. .#. .#. ... .#.", "^": ".#. #.# ... ... ...", "~": "... .#. #.# ... ...",
}
_FONT = {ch: [[c == "#" for c in row] for row in rows.split()] for ch, rows in _FONT_ROWS.items()}
INK, GREY, WHITE, BAR = (0, 0, 0), (110, 110, 110), (255, 255, 255), (59, 82, 139)
TEXT_SCALE = 2  # font pixels per glyph pixel: 6 x 10 characters, 8 pixels apart
CHAR_W, CHAR_H = 4 * TEXT_SCALE, 5 * TEXT_SCALE


def text_width(text: str) -> int:
    return len(text) * CHAR_W


def fit(text: str, chars: int) -> str:
    """``text`` cut to ``chars`` characters, its end marked."""
    return text if len(text) <= chars else text[:max(chars - 2, 1)] + ".."


class Canvas:
    """An RGB picture to draw filled boxes and text on, then encode as PNG."""

    def __init__(self, width: int, height: int):
        self.width, self.height = max(width, 1), max(height, 1)
        self.pixels = bytearray(WHITE * (self.width * self.height))

    def box(self, x: int, y: int, w: int, h: int, rgb: tuple[int, int, int]) -> None:
        x0, x1, y0, y1 = max(x, 0), min(x + w, self.width), max(y, 0), min(y + h, self.height)
        if x0 >= x1:
            return
        line = bytes(rgb) * (x1 - x0)
        for row in range(y0, y1):
            start = 3 * (row * self.width + x0)
            self.pixels[start:start + len(line)] = line

    def text(self, x: int, y: int, text: str, rgb: tuple[int, int, int] = INK) -> None:
        for k, ch in enumerate(text.upper()):
            glyph = _FONT.get(ch, _FONT["?"])
            for gy, row in enumerate(glyph):
                for gx, on in enumerate(row):
                    if on:
                        self.box(x + k * CHAR_W + gx * TEXT_SCALE, y + gy * TEXT_SCALE, TEXT_SCALE, TEXT_SCALE, rgb)

    def png(self) -> bytes:
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[r * stride:(r + 1) * stride]) for r in range(self.height))
        return _png_bytes(self.width, self.height, raw)


def _png_bytes(width: int, height: int, raw: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def png(pixels: list[list[tuple[int, int, int]]]) -> bytes:
    """An 8-bit RGB PNG of ``pixels`` rows (every row the same length)."""
    height, width = len(pixels), len(pixels[0])
    return _png_bytes(width, height, b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels))


_PAD = 8
_LABEL_CHARS = 18  # a row's label column: 18 characters (144 pixels)


def png_histograms(rows: list[tuple[str, list[int], float, float]], title: str, bar: int = 4,
                   height: int = 40) -> bytes:
    """As ``svg_histograms``: one histogram per (label, counts, low, high), each labelled with its
    layer and its range (the x axis runs from low to high), under a title."""
    bins = max((len(c) for _, c, _, _ in rows), default=1)
    left = _PAD + _LABEL_CHARS * CHAR_W + _PAD
    row_h = max(height, 2 * CHAR_H + 6) + _PAD
    top = _PAD + CHAR_H + _PAD
    canvas = Canvas(max(left + bins * bar + _PAD, 2 * _PAD + text_width(title)),
                    top + max(len(rows), 1) * row_h + _PAD)
    canvas.text(_PAD, _PAD, title)
    if not rows:
        canvas.text(_PAD, top, "no finite weights to draw", GREY)
    for k, (label, counts, low, high) in enumerate(rows):
        y0 = top + k * row_h
        canvas.text(_PAD, y0, fit(label, _LABEL_CHARS))
        canvas.text(_PAD, y0 + CHAR_H + 4, fit(f"{low:.3g} .. {high:.3g}", _LABEL_CHARS), GREY)
        peak = max(counts) if counts and max(counts) else 1
        for i, c in enumerate(counts):
            h = round(height * c / peak)
            canvas.box(left + i * bar, y0 + height - h, bar - 1, h, BAR)
        canvas.box(left, y0 + height, len(counts) * bar, 1, GREY)  # the x axis, low to high
    return canvas.png()


def png_bars(labels: list[str], values: list[float | None], title: str, width: int = 300) -> bytes:
    """As ``svg_bars``: one labelled horizontal bar per value, its number beside it, under a title."""
    peak = max((finite_or_zero(v) for v in values), default=0.0) or 1.0
    left, row_h, top = _PAD + _LABEL_CHARS * CHAR_W + _PAD, CHAR_H + 6, _PAD + CHAR_H + _PAD
    canvas = Canvas(max(left + width + _PAD + 10 * CHAR_W, 2 * _PAD + text_width(title)),
                    top + max(len(labels), 1) * row_h + _PAD)
    canvas.text(_PAD, _PAD, title)
    for k, (label, v) in enumerate(zip(labels, values, strict=True)):
        y = top + k * row_h
        w = round(width * finite_or_zero(v) / peak)
        canvas.text(_PAD, y, fit(label, _LABEL_CHARS))
        canvas.box(left, y, w, CHAR_H, (33, 145, 140))
        canvas.text(left + w + 4, y, "-" if v is None else f"{v:.3g}", GREY)
    return canvas.png()


def png_heatmap(matrix: list[list[float]], labels: list[str], title: str, cell: int = 8) -> bytes:
    """As ``svg_heatmap``: cells coloured by ``by_row`` (queries down, keys across), each row labelled
    with its token when a row is tall enough for a line of text, under a title."""
    n = len(matrix)
    labelled = cell >= CHAR_H + 2 and n > 0
    left = _PAD + (8 * CHAR_W + _PAD if labelled else 0)
    top = _PAD + 2 * (CHAR_H + 4) + _PAD
    axes = "rows: queries, columns: keys"
    canvas = Canvas(max(left + n * cell + _PAD, 2 * _PAD + text_width(max(title, axes, key=len))),
                    top + n * cell + _PAD)
    canvas.text(_PAD, _PAD, title)
    canvas.text(_PAD, _PAD + CHAR_H + 4, axes, GREY)
    for i, row in enumerate(by_row(matrix)):
        for j, v in enumerate(row):
            canvas.box(left + j * cell, top + i * cell, cell, cell, colour(v))
        if labelled and i < len(labels):
            canvas.text(_PAD, top + i * cell + (cell - CHAR_H) // 2, fit(labels[i].replace("\n", "~"), 8))
    return canvas.png()
