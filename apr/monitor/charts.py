"""Text charts for the dashboard: EMA smoothing, braille line charts, sparklines and bars.

Pure functions over plain numbers, returning text (rows of ``(text, style)`` runs for the line
chart), so they are tested without a terminal and cost microseconds per redraw. A braille cell
holds 2x4 dots, which gives a line chart four times the vertical resolution of block characters:
what a loss curve needs on an 80x24 terminal.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

SPARK_LEVELS = "▁▂▃▄▅▆▇█"
_BRAILLE_BASE = 0x2800
# Dot bit for (column 0..1, row 0..3) inside one braille cell.
_DOT_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))

Run = tuple[str, str | None]  # a piece of text and the name of its style (None: default)


def ema(points: Sequence[tuple[int, float]], span: int) -> list[tuple[int, float]]:
    """Exponential moving average with a span in *steps*, not points.

    Histories are downsampled (the writer keeps every 1st, 2nd, 4th... point), so the decay
    between two points is ``(1 - alpha) ** gap`` for a gap of ``gap`` steps; a plain per-point EMA
    would smooth more and more as the run grows. Starts at the first value (no bias towards 0).
    """
    if span <= 1:
        return [(s, v) for s, v in points]
    alpha = 2.0 / (span + 1.0)
    out: list[tuple[int, float]] = []
    smoothed = None
    prev_step = None
    for step, value in points:
        if smoothed is None:
            smoothed = value
        else:
            gap = max(1, step - prev_step)
            keep = (1.0 - alpha) ** gap
            smoothed = keep * smoothed + (1.0 - keep) * value
        out.append((step, smoothed))
        prev_step = step
    return out


def axis_label(value: float) -> str:
    """A short label for an axis tick: 4 significant digits, scientific when tiny or huge."""
    if value == 0:
        return "0"
    a = abs(value)
    if a >= 1e5 or a < 1e-3:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.4g}"


def step_label(step: float) -> str:
    """12800 -> '12.8K'; steps on the x axis."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(step) >= scale:
            return f"{step / scale:.3g}{suffix}"
    return f"{int(step)}"


@dataclass(frozen=True)
class Series:
    """Points ``(x, y)`` drawn as a braille line, or as ``marker`` characters when it is set."""

    points: Sequence[tuple[float, float]]
    style: str | None = None
    marker: str | None = None


def _line(x0: int, y0: int, x1: int, y1: int):
    """Dots of a straight segment (Bresenham), both ends included."""
    dx, dy = abs(x1 - x0), -abs(y1 - y0)
    sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
    err = dx + dy
    while True:
        yield x0, y0
        if x0 == x1 and y0 == y1:
            return
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x0 += sx
        if e2 <= dx:
            err += dx
            y0 += sy


@dataclass(frozen=True)
class Mark:
    """A vertical marker at step ``x`` (a steer, a fork point): ``label`` in the plot's top row and a
    dotted rule below it through the cells no curve uses."""

    x: float
    label: str
    style: str | None = None


def line_chart(
    series: Sequence[Series], width: int, height: int, log_y: bool = False, marks: Sequence[Mark] = ()
) -> tuple[list[list[Run]], bool]:
    """Rows of a chart ``width`` x ``height`` cells: a y-axis gutter with 3 labels, the plot, and
    a bottom axis row with the first and last x. Returns (rows, log_used): log scale is used only
    when asked and every y is positive. With no points, returns an empty list. ``marks`` widen the
    x range to hold them."""
    pts = [p for s in series for p in s.points]
    if not pts or width < 12 or height < 3:
        return [], False
    log_used = log_y and all(y > 0 for _, y in pts)
    tf = math.log10 if log_used else (lambda v: v)
    ys = [tf(y) for _, y in pts]
    xs = [x for x, _ in pts] + [m.x for m in marks]
    y_lo, y_hi = min(ys), max(ys)
    if y_hi - y_lo < 1e-12:
        pad = abs(y_hi) * 0.05 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
    x_lo, x_hi = min(xs), max(xs)

    plot_h = height - 1
    untf = (lambda v: 10.0**v) if log_used else (lambda v: v)
    labels = {0: axis_label(untf(y_hi)), plot_h - 1: axis_label(untf(y_lo))}
    if plot_h >= 5:
        mid_row = (plot_h - 1) // 2
        mid_value = untf(y_hi - (y_hi - y_lo) * mid_row / (plot_h - 1))
        if log_used:  # label the round decade nearest the middle, on the row where it falls
            decade = round((y_hi + y_lo) / 2)
            row = round((y_hi - decade) / (y_hi - y_lo) * (plot_h - 1))
            if y_lo < decade < y_hi and 0 < row < plot_h - 1:
                mid_row, mid_value = row, 10.0**decade
        labels[mid_row] = axis_label(mid_value)
    gutter = max(len(t) for t in labels.values()) + 1
    plot_w = width - gutter - 1
    if plot_w < 4:
        return [], False
    dots_w, dots_h = plot_w * 2, plot_h * 4

    def to_dot(x: float, y: float) -> tuple[int, int]:
        fx = 0.0 if x_hi == x_lo else (x - x_lo) / (x_hi - x_lo)
        fy = (y_hi - tf(y)) / (y_hi - y_lo)
        return round(fx * (dots_w - 1)), round(fy * (dots_h - 1))

    bits = [[0] * plot_w for _ in range(plot_h)]
    bit_style: list[list[str | None]] = [[None] * plot_w for _ in range(plot_h)]
    markers: dict[tuple[int, int], tuple[str, str | None]] = {}
    for s in series:
        dots = [to_dot(x, y) for x, y in s.points]
        if s.marker is not None:
            for dx, dy in dots:
                markers[(dy // 4, dx // 2)] = (s.marker, s.style)
            continue
        segments = zip(dots, dots[1:], strict=False) if len(dots) > 1 else [(dots[0], dots[0])]
        for (ax, ay), (bx, by) in segments:
            for dx, dy in _line(ax, ay, bx, by):
                row, col = dy // 4, dx // 2
                bits[row][col] |= _DOT_BITS[dx % 2][dy % 4]
                bit_style[row][col] = s.style
    for m in marks:
        col = to_dot(m.x, untf(y_hi))[0] // 2
        for r in range(plot_h):
            if r == 0:
                markers[(r, col)] = (m.label[:1], m.style)
            elif (r, col) not in markers and not bits[r][col]:
                markers[(r, col)] = ("┊", m.style)

    rows: list[list[Run]] = []
    for r in range(plot_h):
        label = labels.get(r)
        runs: list[Run] = [((label or "").rjust(gutter - 1) + " ", "axis"), ("┤" if label else "│", "axis")]
        for c in range(plot_w):
            if (r, c) in markers:
                runs.append(markers[(r, c)])
            elif bits[r][c]:
                runs.append((chr(_BRAILLE_BASE + bits[r][c]), bit_style[r][c]))
            else:
                runs.append((" ", None))
        rows.append(_merge(runs))
    first, last = step_label(x_lo), step_label(x_hi)
    fill = max(0, plot_w - len(first) - len(last))
    rows.append([(" " * gutter + "└" + first + "─" * fill + last, "axis")])
    return rows, log_used


def _merge(runs: list[Run]) -> list[Run]:
    """Join neighbouring runs of the same style (fewer segments to style and to send)."""
    out: list[Run] = []
    for text, style in runs:
        if out and out[-1][1] == style:
            out[-1] = (out[-1][0] + text, style)
        else:
            out.append((text, style))
    return out


def sparkline(values: Sequence[float], width: int, steps: Sequence[float] | None = None) -> str:
    """An 8-level sparkline exactly ``width`` characters wide, over the steps from the first value
    to the last (``steps``: each value's step; default evenly spaced). More values than columns:
    each column is the mean of its steps'; fewer: the columns between two values are interpolated,
    so a short history (or one thinned out, whose steps are uneven) still spans the whole panel."""
    if steps is None:
        steps = range(len(values))
    points = [(float(s), float(v)) for s, v in zip(steps, values, strict=False)
              if v is not None and math.isfinite(v) and s is not None and math.isfinite(s)]
    if not points or width <= 0:
        return ""
    points.sort(key=lambda p: p[0])
    first, span = points[0][0], points[-1][0] - points[0][0]
    sums, counts = [0.0] * width, [0] * width
    for step, value in points:
        col = 0 if span <= 0 else min(width - 1, int((step - first) / span * width))
        sums[col] += value
        counts[col] += 1
    filled = [c for c in range(width) if counts[c]]
    means = {c: sums[c] / counts[c] for c in filled}
    cols: list[float] = []
    for c in range(width):
        if c in means:
            cols.append(means[c])
            continue
        i = bisect.bisect(filled, c)  # filled[i - 1] < c < filled[i]
        if i == len(filled):  # after the last value (one step only): it holds
            cols.append(means[filled[-1]])
        else:
            before, after = filled[i - 1], filled[i]
            cols.append(means[before] + (means[after] - means[before]) * (c - before) / (after - before))
    lo, hi = min(cols), max(cols)
    if hi - lo <= abs(hi) * 1e-12:
        return SPARK_LEVELS[3] * width
    top = len(SPARK_LEVELS) - 1
    return "".join(SPARK_LEVELS[round((v - lo) / (hi - lo) * top)] for v in cols)


def bar(fraction: float | None, width: int) -> str:
    """``████░░░░`` filled to ``fraction`` (clamped to 0..1); all light shade when unknown."""
    if width <= 0:
        return ""
    if fraction is None or not math.isfinite(fraction):
        return "░" * width
    filled = round(min(1.0, max(0.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def level_bars(values: Sequence[float | None], width: int, top: float | None = None, fill: bool = False) -> str:
    """One column per value, ``▁`` to ``█`` scaled from 0 to ``top`` (default: the largest), ``!``
    for a missing (non-finite) one; at most ``width`` columns (each the largest of its bucket, so a
    spike in one block is not averaged away). ``fill``: exactly ``width`` columns, each value
    widened to an equal share of them (``▂▂▂███▅▅▅``), so a few blocks still span the panel."""
    vals = list(values)
    if not vals or width <= 0:
        return ""
    n = len(vals)
    if n > width:
        buckets = [vals[i * n // width : (i + 1) * n // width] for i in range(width)]
        vals = [None if any(v is None for v in b) else max(b) for b in buckets if b]
    finite = [v for v in vals if v is not None and math.isfinite(v)]
    hi = top if top is not None else max(finite, default=0.0)
    steps = len(SPARK_LEVELS) - 1
    out = []
    for v in vals:
        if v is None or not math.isfinite(v):
            out.append("!")
        elif hi <= 0:
            out.append(SPARK_LEVELS[0])
        else:
            out.append(SPARK_LEVELS[round(min(1.0, max(0.0, v / hi)) * steps)])
    if fill and len(out) < width:
        n = len(out)
        return "".join(out[c * n // width] for c in range(width))
    return "".join(out)
