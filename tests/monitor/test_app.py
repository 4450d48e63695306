"""The dashboard driven headless with Textual's pilot: recorded states, live rewrites, keys, picker."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from apr.monitor.app import HelpScreen, MonitorApp, PickRunScreen
from apr.monitor.discover import ActiveRun
from apr.monitor.settings import MonitorSettings

from .conftest import FIXTURES, copy_fixture, fixed_clock, tiny_config

PANELS = ("#header", "#loss", "#stats", "#lr", "#grad", "#messages")


def drive(app: MonitorApp, body: Callable[..., Awaitable[None]], size: tuple[int, int] = (80, 24)) -> None:
    """Run ``app`` headless at ``size`` and hand its pilot to ``body``."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await body(pilot)

    asyncio.run(main())


async def wait_for(pilot, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.05)


def text(app: MonitorApp, panel: str) -> str:
    return app.query_one(panel).plain


def fixture_app(name: str, **kw) -> MonitorApp:
    return MonitorApp(FIXTURES / name, settings=MonitorSettings(), clock=fixed_clock, **kw)


EXPECTED = {
    "starting": {
        "header": ["albor-pretrain-350m · run 20261118-194000-a1b2c3", "○ STARTING", "step 0 / 19,073", "0.0%"],
        "stats": ["tokens  0 / 10B", "elapsed 3s", "ckpt    none yet"],
        "loss": ["no loss recorded yet"],
        "messages": ["no alerts"],
    },
    "mid_run": {
        "header": ["● RUNNING", "step 12,847 / 19,073", "67.4%", "ep 25.59"],
        "stats": ["tok/s   18,432", "tokens  6.74B / 10B  67.4%", "elapsed 10h 33m", "ETA     5h 06m",
                  "loss    1.7162  val 1.9155", "ckpt    step 12,000 @ 9h 18m"],
        "loss": ["┤", "•", "└1", "12.8K"],
        "gpu": ["util ", " 82%", "VRAM 14.2 / 24.0 GiB  59%", "72°C  312 W"],
        "lr": ["1.20e-6 → 9.82e-5  max 3.00e-4"],
        "grad": ["now 0.296  max 1.919"],
        "messages": ["step 6,900 gradient_norm > 2 → warn: Gradient norm spike"],
    },
    "finished": {
        "header": ["✓ FINISHED", "step 19,073 / 19,073", "100.0%"],
        "stats": ["tokens  10B / 10B  100.0%", "ETA     –", "ckpt    step 19,073 @ 16h 23m"],
        "messages": ["finished: reached max_steps"],
    },
    "failed": {
        "header": ["✗ FAILED", "step 3,400 / 19,073", "17.8%"],
        "stats": ["loss    201.3  val 2.3762", "ckpt    step 3,000 @ 2h 28m"],
        "messages": ["failed: alert 'loss > 10' (action stop): Loss exploded - Andon stop",
                     "step 3,400 loss > 10 → stop: Loss exploded - Andon stop"],
    },
    "stale": {
        "header": ["▲ STALE", "step 5,120 / 19,073", "26.8%"],
        "messages": ["no heartbeat for 1h 00m (stale after 2m 00s): the trainer may have died"],
    },
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_recorded_states_fill_every_panel(name):
    app = fixture_app(name)

    async def body(pilot):
        assert app.status == ("running" if name == "mid_run" else name)
        for panel, needles in EXPECTED[name].items():
            shown = text(app, f"#{panel}")
            for needle in needles:
                assert needle in shown, (panel, needle, shown)
        assert app.query_one("#gpu").display is (name == "mid_run")  # telemetry only where recorded
        assert app.sub_title == app.status

    drive(app, body)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_every_panel_fits_on_the_screen(size):
    app = fixture_app("mid_run")

    async def body(pilot):
        width, height = size
        for panel in (*PANELS, "#gpu"):
            region = app.query_one(panel).region
            assert region.width > 0 and region.height > 0, panel
            assert region.right <= width and region.bottom <= height, (panel, region)
        chart = app.query_one("#loss")
        rows = text(app, "#loss").splitlines()
        assert len(rows) == chart.content_size.height  # the chart uses its whole panel
        assert max(len(r) for r in rows) <= chart.content_size.width

    drive(app, body, size)


def test_keys_pause_scale_help_and_quit(tmp_path):
    run = tmp_path / "run"
    path = copy_fixture("mid_run", run)
    app = MonitorApp(run, settings=MonitorSettings(refresh_ms=50), clock=fixed_clock)

    async def body(pilot):
        chart = app.query_one("#loss")
        assert chart.border_subtitle.endswith(" · linear")  # after the val forecast (12 validations)
        await pilot.press("l")
        assert chart.border_subtitle.endswith(" · log") and app.log_scale
        await pilot.press("l")
        assert chart.border_subtitle.endswith(" · linear")

        await pilot.press("p")
        assert app.paused and "[paused] ● RUNNING" in text(app, "#header")
        doc = json.loads(path.read_text())
        doc["step"] = 13_000
        path.write_text(json.dumps(doc))
        ticks = app.ticks
        await pilot.pause(0.3)
        assert app.ticks == ticks  # paused: no refresh at all
        assert "step 12,847" in text(app, "#header")
        await pilot.press("p")
        assert not app.paused and "step 13,000 / 19,073" in text(app, "#header")

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = str(app.screen.query_one("#help").render())
        for line in ("q   quit", "p   pause / resume refreshing", "l   loss chart: log / linear scale",
                     "EMA over 100 steps", "Refresh every 50 ms", "older\nthan 2m 00s"):
            assert line in help_text, line
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("question_mark")
        await pilot.press("question_mark")
        assert not isinstance(app.screen, HelpScreen)

        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    drive(app, body)
    assert app.return_code == 0


def test_a_live_run_is_followed_from_before_its_start_to_its_failure(tmp_path):
    """The real writer (RunRecorder) rewrites the file; the dashboard follows every status."""
    from apr.track.recorder import RunRecorder

    run = tmp_path / "run"
    app = MonitorApp(run, settings=MonitorSettings(refresh_ms=50))  # the real clock

    async def body(pilot):
        assert app.status == "waiting"
        alerts = [{"condition": "loss > 3", "action": "warn", "message": "loss is high"}]
        rec = RunRecorder(run, tiny_config(alerts=alerts), config_hash="h", total_steps=40, tokens_per_step=64,
                          experiment="live", enabled=False, background=False)
        try:
            await wait_for(pilot, lambda: app.status == "starting")
            assert f"live · run {rec.run_id}" in text(app, "#header")
            rec.start()
            for step in range(1, 6):
                metrics = {"loss": 20.0 / step, "lr": 1e-3 * step, "grad_norm": 1.0 / step, "tokens_per_s": 5e3,
                           "step": step}
                rec.log_step(step, metrics)
                rec.check_alerts(metrics)
            await wait_for(pilot, lambda: "step 5 / 40" in text(app, "#header"))
            assert app.status == "running" and "12.5%" in text(app, "#header")
            assert "loss    4.0000" in text(app, "#stats") and "tokens  320 / 2.56K" in text(app, "#stats")
            assert "step 1 loss > 3 → warning: loss is high (loss=20)" in text(app, "#messages")
            assert "1.00e-3 → 5.00e-3" in text(app, "#lr")
            rec.log_eval(5, 1.5)
            await wait_for(pilot, lambda: "val 1.5000" in text(app, "#stats"))
            rec.finish("failed", "non-finite loss at step 6")
            await wait_for(pilot, lambda: app.status == "failed")
            assert "✗ FAILED" in text(app, "#header")
            assert "failed: non-finite loss at step 6" in text(app, "#messages")
        finally:
            rec.finish("stopped", "test ended")  # no-op when already finished

    drive(app, body)


def test_idle_refreshes_read_nothing_and_redraw_nothing(tmp_path):
    run = tmp_path / "run"
    copy_fixture("mid_run", run)
    app = MonitorApp(run, settings=MonitorSettings(refresh_ms=50), clock=fixed_clock)

    async def body(pilot):
        await wait_for(pilot, lambda: app.ticks >= 2)
        panels = {p: app.query_one(p) for p in (*PANELS, "#gpu")}
        before = {p: w.updates for p, w in panels.items()}
        reads, ticks = app.reader.reads, app.ticks
        await wait_for(pilot, lambda: app.ticks >= ticks + 5)
        assert app.reader.reads == reads  # a stat per refresh, no parse
        assert {p: w.updates for p, w in panels.items()} == before  # no panel redrew

    drive(app, body)


def test_missing_then_malformed_then_good_file(tmp_path):
    run = tmp_path / "run"
    app = MonitorApp(run, settings=MonitorSettings(refresh_ms=50), clock=fixed_clock)

    async def body(pilot):
        assert app.status == "waiting"
        header = text(app, "#header")
        assert header.endswith("… WAITING") and header.startswith("…")
        assert f"{run.parent.name}/run " in header  # a long path is cut at its start: the run folder stays
        assert "waiting: " in text(app, "#messages") and "does not exist" in text(app, "#messages")
        assert "no data yet" in text(app, "#stats")
        run.mkdir()
        (run / "training_state.json").write_text('{"schema_version": 1, "status": "runn')
        await wait_for(pilot, lambda: "not valid JSON" in text(app, "#messages"))
        assert app.status == "waiting"
        copy_fixture("mid_run", run)
        await wait_for(pilot, lambda: app.status == "running")
        assert "step 12,847" in text(app, "#header") and "not valid JSON" not in text(app, "#messages")
        (run / "training_state.json").write_text("")  # a non-atomic writer caught mid-write
        await wait_for(pilot, lambda: "empty" in text(app, "#messages"))
        assert "(showing the last good state)" in text(app, "#messages")
        assert "step 12,847" in text(app, "#header") and app.status == "running"
        (run / "training_state.json").write_text('{"schema_version": 7}')
        await wait_for(pilot, lambda: "upgrade apr" in text(app, "#messages"))

    drive(app, body)


def test_a_state_with_missing_fields_is_shown_and_the_gap_named(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_state.json").write_text(json.dumps({"schema_version": 1, "status": "running", "step": 7,
                                                          "heartbeat": fixed_clock()}))
    app = MonitorApp(run, settings=MonitorSettings(), clock=fixed_clock)

    async def body(pilot):
        assert app.status == "running"
        assert "step 7" in text(app, "#header") and "? · run ?" in text(app, "#header")
        assert "state file lacks: run_id, experiment, status_reason, pid ..." in text(app, "#messages")
        assert "no loss recorded yet" in text(app, "#loss")

    drive(app, body)


def _active(tmp_path: Path, name: str) -> ActiveRun:
    d = tmp_path / name
    copy_fixture("mid_run", d)
    return ActiveRun(run_id=f"id-{name}", experiment=name, output_dir=str(d), status="running", step=5,
                     total_steps=10, heartbeat_age_s=1.0)


def test_several_active_runs_are_offered_in_a_picker(tmp_path):
    runs = [_active(tmp_path, "first"), _active(tmp_path, "second")]
    app = MonitorApp(None, settings=MonitorSettings(), clock=fixed_clock, candidates=runs)

    async def body(pilot):
        assert isinstance(app.screen, PickRunScreen)
        assert app.reader is None
        assert "2 active runs: pick one" in str(app.screen.query_one("#pick-title").render())
        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.run_dir == tmp_path / "second"
        assert "step 12,847" in text(app, "#header")

    drive(app, body)


def test_ctrl_c_quits():
    app = fixture_app("mid_run")

    async def body(pilot):
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running

    drive(app, body)


def test_one_active_run_opens_directly_and_escape_in_the_picker_quits(tmp_path):
    (only,) = [_active(tmp_path, "only")]
    app = MonitorApp(None, settings=MonitorSettings(), clock=fixed_clock, candidates=[only])

    async def opened(pilot):
        assert app.run_dir == Path(only.output_dir) and app.status == "running"

    drive(app, opened)
    app = MonitorApp(None, settings=MonitorSettings(), clock=fixed_clock,
                     candidates=[_active(tmp_path, "a"), _active(tmp_path, "b")])

    async def escape(pilot):
        await pilot.press("escape")
        await pilot.pause()
        assert not app.is_running and app.run_dir is None

    drive(app, escape)


def test_quit_after_a_timeout_and_refresh_from_the_run_config(tmp_path):
    run = tmp_path / "run"
    copy_fixture("finished", run)
    (run / "config.yaml").write_text("monitoring:\n  terminal:\n    refresh_rate: 200\n"
                                     "    charts: [{type: loss_curve, window: 7, show_eta: false}]\n")
    app = MonitorApp(run, clock=fixed_clock, quit_after_s=0.5)

    async def body(pilot):
        assert app.settings.refresh_ms == 200 and app.settings.ema_window == 7
        assert app.query_one("#loss").border_title == "Loss (EMA 7)"
        assert "ETA" not in text(app, "#stats")
        await wait_for(pilot, lambda: not app.is_running, timeout=5.0)

    drive(app, body)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
@pytest.mark.parametrize("points", [1, 2, 15, 400])
def test_sparkline_panels_fill_their_width(tmp_path, size, points):
    """A short history (a 150-step run logs ~15 points) draws across the whole panel, not part of it."""
    run = tmp_path / "run"
    path = copy_fixture("mid_run", run)
    doc = json.loads(path.read_text())
    for key in ("lr_history", "grad_norm_history"):
        doc[key] = [[10 * i, 1e-4 * (1 + (i % 7))] for i in range(points)]
    path.write_text(json.dumps(doc))
    app = MonitorApp(run, settings=MonitorSettings(), clock=fixed_clock)

    async def body(pilot):
        sparks = app.query_one("#sparks")
        panels = [app.query_one(p) for p in ("#lr", "#grad")]
        assert sum(p.outer_size.width for p in panels) == sparks.size.width  # the row is shared out
        for panel in panels:
            line = panel.plain.splitlines()[0]
            assert len(line) == panel.content_size.width > 20, (panel.id, line)
            assert line.strip() == line  # drawn to both edges

    drive(app, body, size=size)


def test_a_run_whose_trainer_was_killed_shows_dead_with_the_reason(tmp_path):
    import socket

    from .test_state import _gone_pid

    run = tmp_path / "run"
    path = copy_fixture("mid_run", run)
    doc = json.loads(path.read_text())
    doc.update(host=socket.gethostname(), pid=_gone_pid(), heartbeat=fixed_clock() - 1)
    path.write_text(json.dumps(doc))
    app = MonitorApp(run, settings=MonitorSettings(), clock=fixed_clock)

    async def body(pilot):
        assert app.status == "dead" and "✗ DEAD" in text(app, "#header")
        assert "is gone without recording an end" in text(app, "#messages")

    drive(app, body, size=(120, 40))


def test_steers_and_a_fork_point_are_marked_on_the_loss_chart_and_the_forecast_shown(tmp_path):
    run = tmp_path / "run"
    path = copy_fixture("mid_run", run)
    state = json.loads(path.read_text())
    state["events"] = [
        {"time": state["heartbeat"], "step": 4000, "kind": "fork", "message": "forked from run p at step 4000",
         "detail": {"parent": {"run_id": "p", "step": 4000}}},
        {"time": state["heartbeat"], "step": 9000, "kind": "steer", "message": "steer: lr_factor=0.5",
         "detail": {"lr_factor": 0.5}},
    ]
    path.write_text(json.dumps(state))
    app = MonitorApp(run, settings=MonitorSettings(), clock=fixed_clock)

    async def body(pilot):
        top = text(app, "#loss").splitlines()[0]
        assert top.count("S") == 1 and top.count("F") == 1 and top.index("F") < top.index("S")
        assert "┊" in text(app, "#loss")
        assert re.fullmatch(r"val forecast \d\.\d{3} ±\d\.\d{3} · linear", app.query_one("#loss").border_subtitle)
        assert "step 9,000 steer: lr_factor=0.5" in text(app, "#messages")

    drive(app, body, (120, 40))
    plain = fixture_app("mid_run")

    async def unmarked(pilot):
        assert "┊" not in text(plain, "#loss")

    drive(plain, unmarked, (120, 40))
