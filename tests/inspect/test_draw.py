"""The pictures: a PNG any decoder reads back pixel for pixel, SVG that parses, terminal glyphs."""

from __future__ import annotations

import struct
import zlib
from xml.etree import ElementTree

from apr.inspect import draw


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height = size
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    return width, height, [raw[r * stride + 1:(r + 1) * stride] for r in range(height)]


def _pixel(rows, x, y) -> tuple[int, int, int]:
    return tuple(rows[y][3 * x:3 * x + 3])


def _ink(rows, x0, x1, y0, y1) -> int:
    """Black (text) pixels in the box."""
    return sum(_pixel(rows, x, y) == draw.INK for y in range(y0, y1) for x in range(x0, x1))


def test_png_heatmap_round_trips_under_its_title_and_token_labels():
    matrix = [[1.0, 0.0], [0.25, 0.75]]
    cell = 12
    width, height, rows = decode_png(draw.png_heatmap(matrix, ["ab", "cd"], "layer 0 head 1", cell=cell))
    left, top = 8 + 8 * draw.CHAR_W + 8, 8 + 2 * (draw.CHAR_H + 4) + 8
    assert height == top + 2 * cell + 8
    assert _pixel(rows, left, top) == draw.colour(1.0) and _pixel(rows, left + cell, top) == draw.colour(0.0)
    assert _pixel(rows, left, top + cell) == draw.colour(1 / 3)  # each row scaled to its maximum (0.25 / 0.75)
    assert _ink(rows, 0, width, 8, 8 + draw.CHAR_H) > 0  # the title
    assert _ink(rows, 0, left, top, top + cell) > 0 and _ink(rows, 0, left, top + cell, top + 2 * cell) > 0


def test_png_pictures_carry_a_title_and_a_label_per_row():
    """Not bare bars: each histogram and each bar is named, with its range or its value."""
    rows_in = [("embed_tokens", [1, 5, 2] * 10, -0.1, 0.1), ("layers.0", [3, 1, 4] * 10, -2.0, 2.5)]
    for data, count in ((draw.png_histograms(rows_in, "weights per layer"), 2),
                        (draw.png_bars(["layers.0", "layers.1"], [0.5, None], "relative update"), 2)):
        width, height, rows = decode_png(data)
        assert width >= 250 and height >= 60
        assert _ink(rows, 0, width, 8, 8 + draw.CHAR_H) > 20  # the title
        label_column = 8 + 18 * draw.CHAR_W
        bands = [y for y in range(8 + draw.CHAR_H + 8, height) if _ink(rows, 0, label_column, y, y + 1)]
        runs = sum(1 for a, b in zip([None, *bands[:-1]], bands, strict=True) if a is None or b - a > 1)
        assert runs >= count  # one label (and range) block per row


def test_the_font_draws_what_it_is_given():
    canvas = draw.Canvas(40, 12)
    canvas.text(0, 0, "1")
    _, _, rows = decode_png(canvas.png())
    scale = draw.TEXT_SCALE
    drawn = ["".join("#" if _pixel(rows, x * scale, y * scale) == draw.INK else "." for x in range(3))
             for y in range(5)]
    assert drawn == [".#.", "##.", ".#.", ".#.", "###"]
    assert draw.fit("embed_tokens_long", 8) == "embed_.."


def test_svg_pictures_parse_and_carry_their_labels():
    for svg in (draw.svg_histograms([("layers.0", [1, 5, 2], -0.1, 0.1)]),
                draw.svg_bars(["layers.0", "layers.1"], [0.5, None], "update"),
                draw.svg_heatmap([[1.0, 0.0], [0.4, 0.6]], ["a<", "b"], "layer 0 head 1")):
        root = ElementTree.fromstring(svg)
        assert root.tag.endswith("svg") and root.findall(".//{http://www.w3.org/2000/svg}rect")
    assert "a&lt;" in draw.svg_heatmap([[1.0]], ["a<"], "t")


def test_terminal_glyphs():
    assert draw.sparkline([0, 4, 8]) == " ▄█" and draw.sparkline([0, 0]) == "  "
    assert draw.sparkline([1, 1000])[0] == "▁"  # a non-empty bin never looks empty
    assert draw.pool([[float(r * 4 + c) for c in range(4)] for r in range(4)], 2) == [[5.0, 7.0], [13.0, 15.0]]
