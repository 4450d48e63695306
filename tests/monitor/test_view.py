"""apr.monitor.view: what the run panel says (issue 24 item 9)."""

from apr.monitor.view import checkpoint_text


def test_checkpoint_time_is_on_the_elapsed_clock_after_a_resume():
    # Started at t=0, stopped, resumed after an hour of downtime: elapsed (1000 s) is run time.
    state = {"started_at": 0.0, "heartbeat": 5000.0, "elapsed_s": 1000.0,
             "last_checkpoint": {"step": 40, "time": 4900.0}}
    text = checkpoint_text(state)
    assert text == "step 40 @ 15m 00s"  # 1000 - (5000 - 4900) s, never later than elapsed (was 1h 21m)


def test_checkpoint_without_clock_fields_shows_only_its_step():
    assert checkpoint_text({"last_checkpoint": {"step": 5, "time": 10.0}}) == "step 5"
    assert checkpoint_text({}) == "none yet"


def test_the_run_panel_shows_in_training_task_scores():
    from apr.monitor.state import normalize
    from apr.monitor.view import stats_lines

    doc = {"status": "running", "step": 500, "heartbeat": 1.0, "loss": 2.5,
           "evals": {"stdlib_nextline": {"step": 500, "acc": 0.41, "acc_norm": 0.44}, "bad": "x"}}
    state, _ = normalize(doc)
    assert state["evals"] == {"stdlib_nextline": {"step": 500.0, "acc": 0.41, "acc_norm": 0.44}}
    assert ("eval", "stdlib_nextline 41.0%") in stats_lines(state)
    state, _ = normalize({**doc, "evals": None})
    assert all(label != "eval" for label, _ in stats_lines(state))


def test_alerts_are_counted_and_styled_by_severity_old_records_by_action():
    from apr.monitor.view import alert_lines

    alerts = [{"step": 1, "condition": "loss > 3", "action": "warn", "message": "high"},  # before severities
              {"step": 2, "condition": "loss > 4", "severity": "info", "action": "warn", "message": "info"},
              {"step": 3, "condition": "loss > 9", "severity": "critical", "action": "stop", "message": "boom"}]
    lines = alert_lines(alerts)
    assert lines[0] == ("alerts: 1 critical, 1 warning, 1 info", "alert.critical")  # styled by the worst
    assert lines[1:] == [("step 3 loss > 9 → critical: boom", "alert.critical"),
                         ("step 2 loss > 4 → info: info", "alert.info"),
                         ("step 1 loss > 3 → warn: high", "alert.warning")]
    assert alert_lines(alerts[:1]) == [("step 1 loss > 3 → warn: high", "alert.warning")]  # one: no count line
    assert alert_lines([]) == []


def test_an_orchestrated_run_shows_its_strategy_in_force_and_its_decisions():
    """The strategy comes from the newest orchestration event that names one (a decision's winner,
    a switch, a safety rollback's target); decisions and branches are info lines, not alerts."""
    from apr.monitor.state import normalize
    from apr.monitor.view import messages

    events = [{"step": 0, "kind": "strategy", "message": "strategy conservative_adamw (initial)",
               "detail": {"strategy": "conservative_adamw"}},
              {"step": 100, "kind": "decision", "message": "decision 1: sgd_escape wins",
               "detail": {"winner": "sgd_escape"}},
              {"step": 100, "kind": "switch", "message": "strategy conservative_adamw -> sgd_escape",
               "detail": {"from": "conservative_adamw", "to": "sgd_escape"}}]
    state, _ = normalize({"status": "running", "step": 150, "heartbeat": 1.0, "events": events})
    lines = messages(None, state, "running", 2.0, 600.0)
    assert ("strategy sgd_escape (1 decision)", "msg.info") in lines
    assert ("step 100 decision 1: sgd_escape wins", "msg.info") in lines
    state, _ = normalize({"status": "running", "step": 150, "heartbeat": 1.0, "events": events[:1]})
    assert ("strategy conservative_adamw (0 decisions)", "msg.info") in messages(None, state, "running", 2.0, 600.0)


def test_a_spark_caption_keeps_max_whole_in_a_narrow_panel():
    """At width 30 (28 columns inside the border) the lr caption lost its `max`."""
    from apr.monitor.view import fit_caption, lr_view, metric_view

    state = {"lr_history": [[1, 3e-4], [2, 2.5e-4], [3, 3e-5]], "val_loss_history": [[1, 9.4], [2, 2.0], [3, 3.1]]}
    assert len(lr_view(state).caption) > 28  # "3.00e-4 → 3.00e-5  max 3.00e-4": cut at 28 before
    for view in (lr_view(state), metric_view(state, "val_loss")):
        for width in (28, 24, 20, 14):
            shown = fit_caption(view.caption, width)
            assert len(shown) <= width and shown.endswith(view.caption.split("max ")[1]), (width, shown)
            assert "max " in shown
        # with room for two lines, nothing is dropped
        two = fit_caption(view.caption, 20, lines=2).splitlines()
        assert len(two) == 2 and all(len(line) <= 20 for line in two)
        assert " ".join(two).split() == view.caption.split()
    assert fit_caption("now 1  max 2", 80) == "now 1  max 2"


def test_the_forecast_final_val_loss_with_its_band_from_the_validation_history():
    from apr.monitor.state import normalize
    from apr.monitor.view import forecast_text, forecast_view

    history = [[s, 2.0 + 6.0 * s ** -0.5] for s in (100, 200, 300, 400, 500)]
    base = {"status": "running", "step": 500, "total_steps": 2000, "heartbeat": 1.0}
    state, _ = normalize({**base, "val_loss_history": history})
    ahead = forecast_view(state)
    assert ahead["step"] == 2000 and abs(ahead["loss"] - (2.0 + 6.0 * 2000 ** -0.5)) < 1e-3
    half = (ahead["high"] - ahead["low"]) / 2
    assert forecast_text(ahead) == f"val forecast {ahead['loss']:.3f} ±{half:.3f}"
    state, _ = normalize({**base, "val_loss_history": history[:3]})
    assert forecast_view(state) is None  # 3 validations: too few for a forecast
    state, _ = normalize({**base, "step": 2000, "val_loss_history": history})
    assert forecast_view(state) is None  # at its last step: nothing left to forecast


def test_steer_and_fork_events_become_chart_marks_other_events_do_not():
    from apr.monitor.state import normalize
    from apr.monitor.view import chart_marks

    events = [{"time": 1.0, "step": 10, "kind": "fork", "message": "m"},
              {"time": 2.0, "step": 30, "kind": "steer", "message": "m"},
              {"time": 3.0, "step": 40, "kind": "steer_rejected", "message": "m"},
              {"time": 4.0, "step": 50, "kind": "rollback", "message": "m"}]
    state, _ = normalize({"status": "running", "step": 60, "heartbeat": 1.0, "events": events})
    assert [(m.x, m.label, m.style) for m in chart_marks(state)] == [(10.0, "F", "fork"), (30.0, "S", "steer")]
