"""Charts: EMA over steps, braille line charts, sparklines, bars."""

from __future__ import annotations

import math

import pytest

from apr.monitor.charts import SPARK_LEVELS, Series, axis_label, bar, ema, line_chart, sparkline, step_label


def test_ema_of_a_constant_is_the_constant():
    assert ema([(s, 2.5) for s in range(50)], 10) == [(s, 2.5) for s in range(50)]


def test_ema_decay_counts_steps_not_points():
    dense = ema([(0, 0.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)], 9)
    sparse = ema([(0, 0.0), (4, 1.0)], 9)  # the same run, downsampled
    assert sparse[-1][1] == pytest.approx(dense[-1][1])
    assert 0 < sparse[-1][1] < 1


def test_ema_lags_a_step_change_and_catches_up():
    points = [(s, 0.0 if s < 100 else 1.0) for s in range(400)]
    out = dict(ema(points, 20))
    assert out[99] == 0.0 and 0.0 < out[105] < 0.5 and out[399] > 0.999


def test_ema_span_one_is_identity():
    pts = [(1, 3.0), (2, 1.0), (5, 2.0)]
    assert ema(pts, 1) == pts


def _text(rows):
    return ["".join(t for t, _ in row) for row in rows]


def test_line_chart_draws_a_falling_curve_top_left_to_bottom_right():
    pts = [(s, 10.0 - s / 10) for s in range(0, 101)]
    rows, log_used = line_chart([Series(pts, "train")], 40, 10)
    lines = _text(rows)
    assert not log_used and len(lines) == 10
    assert all(len(line) == 40 for line in lines)
    gutter = lines[0].index("┤") + 1
    assert lines[0][gutter] != " "  # first point in the top-left cell
    assert lines[8][-1] != " "  # last point in the bottom-right plot cell
    assert lines[0][-1] == " " and lines[8][gutter] == " "
    assert lines[0].lstrip().startswith("10")  # top label is the max
    assert lines[8].lstrip().startswith("0")  # bottom label is the min
    assert lines[-1].strip().startswith("└0") and lines[-1].endswith("100")
    # every plot column has a dot: the curve is connected
    assert all(any(line[c] != " " for line in lines[:-1]) for c in range(gutter, 40))


def test_line_chart_braille_characters_only_in_the_plot():
    rows, _ = line_chart([Series([(0, 1.0), (10, 2.0)], "train")], 30, 6)
    plot = "".join(t for row in rows[:-1] for t, s in row if s == "train")
    assert plot and all(0x2800 <= ord(c) <= 0x28FF for c in plot)


def test_markers_are_placed_in_their_cells():
    rows, _ = line_chart(
        [Series([(0, 5.0), (100, 1.0)], "train"), Series([(0, 5.0), (100, 1.0)], "val", marker="•")], 30, 6
    )
    lines = _text(rows)
    assert "•" in lines[0] and "•" in lines[4]
    assert any(s == "val" for t, s in rows[0] if t == "•")


def test_log_scale_spreads_decades_evenly():
    pts = [(0, 100.0), (1, 10.0), (2, 1.0)]
    rows, log_used = line_chart([Series(pts)], 30, 9, log_y=True)
    assert log_used
    lines = _text(rows)
    assert lines[0].lstrip().startswith("100") and lines[7].lstrip().startswith("1 ")
    mid = lines[3]
    assert mid.lstrip().startswith("10") or "10" in lines[4][:6]


def test_log_scale_refused_for_non_positive_values():
    _, log_used = line_chart([Series([(0, 1.0), (1, 0.0)])], 30, 6, log_y=True)
    assert log_used is False


def test_flat_and_single_point_series_do_not_divide_by_zero():
    rows, _ = line_chart([Series([(5, 2.0)])], 20, 5)
    plotted = [t for row in rows[:-1] for t, style in row if style != "axis"]
    assert any(ch.strip() for t in plotted for ch in t), "a single point must still be drawn"
    rows, _ = line_chart([Series([(s, 2.0) for s in range(10)])], 20, 5)
    assert len(rows) == 5


def test_no_points_or_no_room_gives_no_rows():
    assert line_chart([], 40, 10) == ([], False)
    assert line_chart([Series([(0, 1.0), (1, 2.0)])], 5, 10) == ([], False)


def test_sparkline_levels_and_width():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == SPARK_LEVELS
    long = sparkline([math.sin(i / 10) for i in range(1000)], 30)
    assert len(long) == 30
    assert sparkline([], 10) == "" and sparkline([1.0], 0) == ""


def test_a_short_history_spans_the_whole_width():
    # fewer values than columns (a short run, a history thinned out): interpolated, never half a line
    assert sparkline([0.0, 7.0], 8) == SPARK_LEVELS
    assert sparkline([3.0] * 5, 10) == SPARK_LEVELS[3] * 10
    assert sparkline([2.0], 6) == SPARK_LEVELS[3] * 6
    assert sparkline([1.0, float("nan"), 2.0], 10) == "▁▂▃▃▄▅▆▆▇█"  # the gap is bridged, not dropped
    for n in (2, 3, 15, 57, 58, 59, 400):
        assert len(sparkline([math.sin(i) for i in range(n)], 58)) == 58, n


def test_a_sparkline_is_spread_over_steps_not_over_points():
    # a thinned history: steps 0..8 one by one, then 16, 32, 64; the line is a ramp over steps
    steps = [0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]
    line = sparkline([float(s) for s in steps], 64, steps)
    assert line == "".join(sorted(line)) and line[0] == SPARK_LEVELS[0] and line[-1] == SPARK_LEVELS[-1]
    assert line[32] in SPARK_LEVELS[3:5]  # half way in steps is half way up (by points it would be the top)


def test_bar_fills_proportionally_and_clamps():
    assert bar(0.5, 10) == "█" * 5 + "░" * 5
    assert bar(1.7, 4) == "████" and bar(-1, 4) == "░░░░" and bar(None, 3) == "░░░"


@pytest.mark.parametrize(
    "value, text", [(0, "0"), (3.21456, "3.215"), (0.0003, "3.0e-4"), (123456.0, "1.2e5"), (10.0, "10")]
)
def test_axis_labels(value, text):
    assert axis_label(value) == text


def test_step_labels():
    assert step_label(12_847) == "12.8K" and step_label(7) == "7" and step_label(2_500_000) == "2.5M"


def test_a_mark_draws_its_letter_on_top_and_a_dotted_rule_where_no_curve_is():
    from apr.monitor.charts import Mark

    rows, _ = line_chart([Series([(0, 5.0), (100, 1.0)], "train")], 30, 6, marks=[Mark(50, "S", "steer")])
    lines = _text(rows)
    col = lines[0].index("S")
    assert [ln[col] for ln in lines[1:-1]].count("┊") >= 3  # the rule, except where the curve crosses it
    assert all("S" not in ln for ln in lines[1:])
    assert any(s == "steer" for t, s in rows[0] if t == "S")
    left = lines[0].index("┤") + 1  # the plot's first column
    assert abs((col - left) - (len(lines[0]) - left) / 2) <= 1  # step 50 of 0..100: the middle


def test_a_mark_outside_the_curve_widens_the_x_range():
    from apr.monitor.charts import Mark

    rows, _ = line_chart([Series([(51, 5.0), (100, 1.0)], "train")], 30, 6, marks=[Mark(50, "F", "fork")])
    lines = _text(rows)
    assert lines[-1].split("└")[1].startswith("50")  # the axis starts at the fork step
    assert lines[0][lines[0].index("┤") + 1] == "F"  # at the plot's left edge
