"""Number formats on the dashboard."""

from __future__ import annotations

import pytest

from apr.fmt import DASH, fmt_count, fmt_duration, fmt_gib, fmt_int, fmt_loss, fmt_percent, fmt_sci


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (42, "42s"), (724, "12m 04s"), (11_100, "3h 05m"), (137_000, "1d 14h 03m"), (None, DASH),
     (-5, DASH), (float("inf"), DASH)],
)
def test_durations(seconds, text):
    assert fmt_duration(seconds) == text


def test_numbers():
    assert fmt_int(12_847) == "12,847" and fmt_int(None) == DASH and fmt_int(True) == DASH
    assert fmt_count(5_200_000_000) == "5.2B"
    assert fmt_loss(2.43121) == "2.4312" and fmt_loss(201.34) == "201.3" and fmt_loss(float("nan")) == DASH
    assert fmt_sci(0.0003) == "3.00e-4" and fmt_sci(0.42) == "0.420" and fmt_sci(0) == "0"
    assert fmt_gib(15_246_000_000) == "14.2" and fmt_percent(0.674) == "67.4%"


def test_epoch_has_two_decimals():
    from apr.fmt import fmt_epoch

    assert fmt_epoch(0.0498339) == "0.05" and fmt_epoch(12) == "12.00" and fmt_epoch(None) == DASH


def test_one_module_formats_numbers():
    """No other module defines its own number formatter (issue 13 item 8)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "apr"
    pattern = re.compile(r"^def _?(fmt|format)_?(n|count|bytes|rate|eta|lr|giga|flops|duration|time|loss)\b|"
                         r"^def _(n|lr|giga|flops|fmt)\(", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "fmt.py" and pattern.search(p.read_text())]
    assert offenders == []
