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


def test_png_heatmap_round_trips():
    matrix = [[1.0, 0.0], [0.25, 0.75]]
    width, height, rows = decode_png(draw.png_heatmap(matrix, cell=3))
    assert (width, height) == (6, 6)
    assert rows[0][:3] == bytes(draw.colour(1.0)) and rows[0][9:12] == bytes(draw.colour(0.0))
    assert rows[4][:3] == bytes(draw.colour(1 / 3))  # each row scaled to its maximum (0.25 / 0.75)


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
