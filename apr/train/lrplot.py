"""The LR finder's curve as text (for the terminal), SVG (hand-written, no plotting library) and JSON."""

from __future__ import annotations

import math


def _scale(values: list[float], lo: float, hi: float, size: int) -> list[int]:
    span = (hi - lo) or 1.0
    return [min(size - 1, max(0, round((v - lo) / span * (size - 1)))) for v in values]


def text_plot(lrs: list[float], losses: list[float], mark: float, width: int = 60, height: int = 14) -> str:
    """Smoothed loss against log10(lr): '*' the curve, '|' the suggested LR."""
    xs = [math.log10(x) for x in lrs]
    lo, hi = min(losses), max(losses)
    cols = _scale(xs, xs[0], xs[-1], width)
    rows = _scale(losses, lo, hi, height)
    grid = [[" "] * width for _ in range(height)]
    mark_col = _scale([math.log10(mark)], xs[0], xs[-1], width)[0]
    for r in range(height):
        grid[r][mark_col] = "|"
    for c, r in zip(cols, rows, strict=True):
        grid[height - 1 - r][c] = "*"
    lines = [f"{hi:8.3f} +" + "".join(grid[0])]
    lines += ["         |" + "".join(row) for row in grid[1:-1]]
    lines.append(f"{lo:8.3f} +" + "".join(grid[-1]))
    left, right = f"{lrs[0]:.1e}", f"{lrs[-1]:.1e}"
    lines.append("          " + left + " " * max(1, width - len(left) - len(right)) + right + "  (lr, log scale)")
    return "\n".join(lines)


def svg_plot(lrs: list[float], losses: list[float], smoothed: list[float], mark: float, rule: str) -> str:
    """A 640x400 SVG: raw loss (grey), smoothed loss (blue), the suggestion (red line), log10 lr axis."""
    w, h, left, right, top, bottom = 640, 400, 60, 20, 30, 50
    xs = [math.log10(x) for x in lrs]
    x0, x1 = xs[0], xs[-1]
    every = losses + smoothed
    y0, y1 = min(every), max(every)

    def px(x: float) -> float:
        return left + (x - x0) / ((x1 - x0) or 1) * (w - left - right)

    def py(y: float) -> float:
        return h - bottom - (y - y0) / ((y1 - y0) or 1) * (h - top - bottom)

    def path(values: list[float]) -> str:
        pairs = enumerate(zip(xs, values, strict=True))
        return " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in pairs)

    ticks = []
    for d in range(math.ceil(x0), math.floor(x1) + 1):
        ticks.append(f'<line x1="{px(d):.1f}" y1="{h - bottom}" x2="{px(d):.1f}" y2="{h - bottom + 5}" stroke="#000"/>'
                     f'<text x="{px(d):.1f}" y="{h - bottom + 18}" font-size="11" text-anchor="middle">1e{d}</text>')
    for y in (y0, (y0 + y1) / 2, y1):
        ticks.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" font-size="11" text-anchor="end">{y:.2f}</text>')
    mx = px(math.log10(mark))
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">',
        f'<rect width="{w}" height="{h}" fill="#fff"/>',
        f'<text x="{w / 2}" y="18" font-size="13" text-anchor="middle">'
        f'LR range test: suggested {mark:.3g} ({rule})</text>',
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#000"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#000"/>',
        *ticks,
        f'<text x="{w / 2}" y="{h - 12}" font-size="12" text-anchor="middle">learning rate (log scale)</text>',
        f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" text-anchor="middle">loss</text>',
        f'<path d="{path(losses)}" fill="none" stroke="#bbb" stroke-width="1"/>',
        f'<path d="{path(smoothed)}" fill="none" stroke="#1f77b4" stroke-width="2"/>',
        f'<line x1="{mx:.1f}" y1="{top}" x2="{mx:.1f}" y2="{h - bottom}" stroke="#d62728" stroke-dasharray="4 3"/>',
        "</svg>", ""])
