import json
import math
import subprocess
import sys
import textwrap
import time

import pytest

from apr.errors import AprError
from apr.track.state import (
    HISTORY_POINTS,
    STATE_FILE,
    History,
    RunState,
    effective_status,
    is_stale,
    read_state,
    stale_threshold,
)


def test_history_stays_bounded_and_keeps_first_and_latest_points():
    h = History()
    for step in range(1, 100_001):
        h.add(step, 1.0 / step)
        assert len(h) <= HISTORY_POINTS
    pts = h.points()
    assert len(pts) <= HISTORY_POINTS
    assert len(pts) > HISTORY_POINTS // 2  # decimation halves, it does not collapse
    assert pts[0] == [1, 1.0]
    assert pts[-1] == [100_000, 1.0 / 100_000]
    steps = [p[0] for p in pts]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    # Evenly spread over the run: no gap is more than twice the typical one (the latest point aside).
    gaps = [b - a for a, b in zip(steps[:-2], steps[1:-1], strict=True)]
    assert max(gaps) <= 2 * min(gaps)


def test_history_skips_non_finite_and_replaces_replayed_steps():
    h = History(max_points=8)
    for step in range(1, 6):
        h.add(step, float(step))
    h.add(6, math.nan)
    h.add(7, math.inf)
    h.add(8, None)
    assert [p[0] for p in h.points()] == [1, 2, 3, 4, 5]
    h.add(3, 30.0)  # a resumed run replays step 3: later points go, the new value stays
    assert h.points() == [[1, 1.0], [2, 2.0], [3, 30.0]]


def test_state_document_is_valid_json_with_null_for_non_finite_values():
    st = RunState(run_id="r", loss=math.nan, grad_norm=math.inf)
    st.histories["loss"].add(1, 2.5)
    doc = json.loads(st.to_json_bytes())
    assert doc["loss"] is None and doc["grad_norm"] is None
    assert doc["loss_history"] == [[1, 2.5]]
    assert doc["schema_version"] == 1
    for key in ("val_loss_history", "lr_history", "grad_norm_history", "tokens_per_s_history"):
        assert doc[key] == []


def test_alerts_in_state_keep_only_the_latest_fifty():
    st = RunState()
    for i in range(60):
        st.add_alert({"step": i})
    assert [a["step"] for a in st["alerts"]] == list(range(10, 60))


def test_read_state_accepts_a_folder_or_the_file(tmp_path):
    (tmp_path / STATE_FILE).write_bytes(RunState(run_id="abc").to_json_bytes())
    assert read_state(tmp_path)["run_id"] == "abc"
    assert read_state(tmp_path / STATE_FILE)["run_id"] == "abc"


@pytest.mark.parametrize(
    "content, code",
    [
        (None, "track.state_missing"),
        ('{"schema_version": 1,\n "step": ', "track.state_malformed"),
        ("[1, 2]", "track.state_malformed"),
        ('{"step": 1}', "track.state_malformed"),
        ('{"schema_version": 99}', "track.state_version"),
    ],
)
def test_read_state_errors_are_clear_findings(tmp_path, content, code):
    if content is not None:
        (tmp_path / STATE_FILE).write_text(content)
    with pytest.raises(AprError) as e:
        read_state(tmp_path)
    f = e.value.findings[0]
    assert f.code == code
    assert f.file.endswith(STATE_FILE)
    if code == "track.state_malformed" and content.startswith('{"schema_version": 1,'):
        assert f.line == 2


def test_stale_only_when_active_and_heartbeat_old():
    now = 10_000.0
    running = {"status": "running", "heartbeat": now - 121}
    assert is_stale(running, now)
    assert effective_status(running, now) == "stale"
    assert not is_stale({**running, "heartbeat": now - 60}, now)
    assert not is_stale({**running, "status": "finished"}, now)
    assert not is_stale({"status": "running", "heartbeat": None}, now)
    assert is_stale({**running, "heartbeat": now - 30}, now, threshold_s=10)
    # A run that logs every 60 s is not dead after 2 minutes of silence.
    slow = {**running, "log_period_s": 60.0}
    assert stale_threshold(slow) == 600.0
    assert not is_stale(slow, now)
    assert effective_status({**running, "heartbeat": now}, now) == "running"


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from track_helpers import make_config
    from apr.track.recorder import RunRecorder

    rec = RunRecorder(Path({run!r}), make_config(), config_hash="h", total_steps={n}, tokens_per_step=64,
                      enabled=False, background=False)
    rec.start()
    for step in range(1, {n} + 1):
        rec.log_step(step, {{"loss": 10.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 5e3}})
    rec.finish("finished")
    """
)


@pytest.mark.slow
def test_reader_never_sees_a_torn_state_file_while_a_run_rewrites_it(tmp_path):
    """A writer process rewrites training_state.json 2000 times; a reader parses it in a tight loop."""
    n = 2000
    run = tmp_path / "run"
    script = WRITER.format(tests=str(__import__("pathlib").Path(__file__).parent), run=str(run), n=n)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    parses, failures, steps_seen = 0, [], set()
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            try:
                doc = read_state(run)
            except AprError as e:
                if e.findings[0].code == "track.state_missing":
                    if proc.poll() is not None:
                        break
                    continue
                failures.append(e.findings[0].message)
                continue
            parses += 1
            steps_seen.add(doc["step"])
            if doc["status"] == "finished":
                break
    finally:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert failures == []
    assert parses > 100
    assert len(steps_seen) > 20  # the reader really overlapped with many rewrites
    final = read_state(run)
    assert final["status"] == "finished" and final["step"] == n
    assert len(final["loss_history"]) <= HISTORY_POINTS


def test_non_finite_values_nested_in_a_field_become_null():
    st = RunState(gpu={"utilization": math.nan, "power_w": math.inf, "name": "x"}, alerts=[{"time": math.nan}])
    doc = json.loads(st.to_json_bytes())
    assert doc["gpu"] == {"utilization": None, "power_w": None, "name": "x"}
    assert doc["alerts"] == [{"time": None}]
