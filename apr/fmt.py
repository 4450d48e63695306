"""How apr writes numbers, times and recorded text for people: one module used by the CLI, the plan
renderer and the monitor. Short, stable formats (every cell of an 80-column screen counts)."""

from __future__ import annotations

import math
import re
import time

DASH = "–"


def format_count(n: float) -> str:
    """Short form for display: 1234567 -> '1.23M'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def format_bytes(n: float) -> str:
    for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{int(n)} B"


def fmt_number(value) -> str:
    """Counts in plan text: '67,977'; floats in 4 significant digits; '?' when unknown."""
    if value is None:
        return "?"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return f"{value:,}"


def fmt_giga(value: float) -> str:
    """A FLOP count with SI prefixes (G, not B): 2.69G."""
    return format_count(value).replace("B", "G")


def fmt_flops(value: float) -> str:
    return f"{value:.3g} FLOP"


def fmt_lr(value: float) -> str:
    """Learning rates in plan text: 3e-05, 0.0003."""
    return f"{value:.3g}"


def fmt_rate(v: float) -> str:
    """Tokens per second in step lines: 412, 12.4k, 1.23M."""
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def fmt_estimate(seconds: float) -> str:
    """A modelled duration, as rounded as the model behind it: '45 s', '18.5 min', '3.2 h', '4.1 days'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


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


def fmt_epoch(v) -> str:
    """Epochs with two decimals: 0.0498339 -> '0.05'; 12 -> '12.00'."""
    return f"{v:.2f}" if _ok(v) else DASH


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


def fmt_seconds(seconds) -> str:
    """Seconds in the decision's line: 0.25 s, 12 s, 3.1 min, 2.4 h."""
    if not _ok(seconds) or seconds < 0:
        return DASH
    if seconds < 10:
        return f"{seconds:.3g} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def fmt_gib(v) -> str:
    """Bytes as GiB with one decimal: VRAM readings."""
    return f"{v / 2**30:.1f}" if _ok(v) else DASH


def fmt_percent(fraction) -> str:
    return f"{100.0 * fraction:.1f}%" if _ok(fraction) else DASH


def fmt_ratio(v) -> str:
    """A speed or memory ratio against a baseline: 0.48x, 1.17x."""
    return f"{v:.2f}x" if _ok(v) else DASH


def fmt_float(v) -> str:
    """Any other float, in at most 6 significant digits: 0.39867109634551495 -> '0.398671',
    0.00010000000000000005 -> '0.0001', 491520.0 -> '491520'."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return DASH if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.6g}"


def fmt_value(v) -> str:
    """A recorded metric or param value: integral floats as integers, other floats via fmt_float."""
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return fmt_float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else safe_text(v)


def fmt_timestamp(t) -> str:
    """A Unix time as local 'YYYY-MM-DD HH:MM'."""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if _ok(t) else "-"


def fmt_clock(seconds) -> str:
    """A duration as 'H:MM:SS' (tables of runs)."""
    if not _ok(seconds):
        return "-"
    s = int(max(seconds, 0))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}"


# C0 controls (tab and newline included: a record is one cell), DEL and the C1 controls.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe_text(value) -> str:
    """Text from a record (experiment names, paths, reasons) made safe to print on a terminal:
    control characters such as ESC become visible escapes (``\\x1b``), never terminal commands."""
    text = "-" if value is None else str(value)
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def fmt_setting(value) -> str:
    """A config setting's value in a table (a sweep's parameters): a float to 4 significant digits,
    anything else as safe text."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return safe_text(value)
