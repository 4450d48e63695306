"""The loss chart's EMA window follows the run's length unless the config sets one (issue 24 item 9)."""

import math

from apr.monitor.charts import ema
from apr.monitor.settings import MonitorSettings, load_settings


def test_window_from_the_runs_length():
    auto = MonitorSettings()
    assert auto.window_for(200) == 4
    assert auto.window_for(20) == 1
    assert auto.window_for(1_000_000) == 100
    assert auto.window_for(None, last_step=500) == 10
    assert MonitorSettings(ema_window=7).window_for(200) == 7


def test_a_short_runs_smoothed_loss_follows_the_loss():
    # A 200-step run whose loss falls from 10.4 towards 6: at step 30 it is about 6.26.
    points = [(s, 6.0 + 4.4 * math.exp(-s / 12)) for s in range(1, 201)]
    at30 = dict(ema(points, MonitorSettings().window_for(200)))[30]
    assert abs(at30 - points[29][1]) < 0.15
    assert dict(ema(points, 100))[30] - points[29][1] > 0.6  # the old fixed window lagged badly


def test_an_explicit_window_in_the_run_config_wins(tmp_path):
    charts = "monitoring:\n  terminal:\n    charts:\n"
    (tmp_path / "config.yaml").write_text(charts + "      - {type: loss_curve, window: 7}\n")
    assert load_settings(tmp_path).window_for(200) == 7
    (tmp_path / "config.yaml").write_text(charts + "      - {type: loss_curve}\n")
    assert load_settings(tmp_path).window_for(200) == 4
