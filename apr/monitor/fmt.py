"""Short, stable number formats for the dashboard (every cell of an 80-column screen counts)."""

from __future__ import annotations

import math

from apr.config.numbers import format_count

DASH = "–"


def _ok(v) -> bool:
    return v is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def fmt_int(v) -> str:
    """12847 -> '12,847'."""
    return f"{int(v):,}" if _ok(v) else DASH


def fmt_count(v) -> str:
    """5_200_000_000 -> '5.2B' (tokens, parameters)."""
    return format_count(float(v)) if _ok(v) else DASH


def fmt_loss(v) -> str:
    """Losses and perplexities: 4 decimals below 100, fewer above, scientific when huge."""
    if not _ok(v):
        return DASH
    a = abs(v)
    if a >= 1e5:
        return fmt_sci(v)
    if a >= 100:
        return f"{v:.1f}"
    return f"{v:.4f}"


def fmt_sci(v) -> str:
    """Learning rates and norms across decades: 0.0003 -> '3.00e-4'; 0.42 -> '0.420'."""
    if not _ok(v):
        return DASH
    if v == 0:
        return "0"
    if 1e-2 <= abs(v) < 1e4:
        return f"{v:.3g}" if abs(v) >= 100 else f"{v:.3f}"
    mantissa, exponent = f"{v:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt_duration(seconds) -> str:
    """42 -> '42s'; 724 -> '12m 04s'; 11100 -> '3h 05m'; 137000 -> '1d 14h 03m'."""
    if not _ok(seconds) or seconds < 0:
        return DASH
    s = int(round(seconds))
    days, rem = divmod(s, 86400)
    hours, rem = divmod(rem, 3600)
    minutes, secs = divmod(rem, 60)
    if days:
        return f"{days}d {hours}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def fmt_gib(v) -> str:
    """Bytes as GiB with one decimal: VRAM readings."""
    return f"{v / 2**30:.1f}" if _ok(v) else DASH


def fmt_percent(fraction) -> str:
    return f"{100.0 * fraction:.1f}%" if _ok(fraction) else DASH
