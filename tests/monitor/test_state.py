"""Tolerant reading of training_state.json: whatever is on disk, the reader says what it found."""

from __future__ import annotations

import json
import os

import pytest

from apr.fsutil import atomic_write_json
from apr.monitor.state import (
    STALE_FLOOR_S,
    StateReader,
    effective_status,
    normalize,
    read_once,
    stale_threshold,
)

from .conftest import FIXTURE_NAMES, FIXTURE_NOW, FIXTURES, copy_fixture


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_recorded_fixtures_read_completely(name):
    reading = read_once(FIXTURES / name)
    assert reading.ok, reading.problem
    assert reading.missing_fields == ()
    assert reading.state["run_id"] == "20261118-194000-a1b2c3"


def test_mid_run_fields_are_typed():
    state = read_once(FIXTURES / "mid_run").state
    assert state["status"] == "running"
    assert state["step"] == 12_847 and state["total_steps"] == 19_073
    assert state["gpu"]["name"] == "NVIDIA GeForce RTX 4090"
    assert state["last_checkpoint"]["step"] == 12_000
    steps = [s for s, _ in state["loss_history"]]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 12_847
    assert all(isinstance(v, float) for _, v in state["loss_history"])


def test_missing_file_and_missing_folder_are_reported(tmp_path):
    r = read_once(tmp_path)
    assert r.kind == "missing" and r.problem == "training_state.json does not exist yet (the run has not started?)"
    r = read_once(tmp_path / "not-yet")
    assert r.kind == "missing" and r.problem == "the run folder does not exist (yet)"
    assert r.path == tmp_path / "not-yet" / "training_state.json"


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "empty"),
        (b'{"schema_version": 1, "step": 1', "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"step": 3}', "no valid schema_version"),
        (b'{"schema_version": "1"}', "no valid schema_version"),
        (b"\xff\xfe\x00", "not UTF-8"),
        (b"[" * 100_000, "not valid JSON"),
    ],
    ids=["empty", "truncated", "array", "no-version", "string-version", "not-utf8", "too-deep"],
)
def test_malformed_content_is_a_reading_not_an_exception(run_dir, content, needle):
    (run_dir / "training_state.json").write_bytes(content)
    r = read_once(run_dir)
    assert r.kind == "malformed" and r.state is None
    assert needle in r.problem


def test_truncated_fixture_is_malformed(run_dir):
    text = (FIXTURES / "mid_run" / "training_state.json").read_bytes()
    (run_dir / "training_state.json").write_bytes(text[: len(text) // 2])
    r = read_once(run_dir)
    assert r.kind == "malformed" and "line" in r.problem


def test_newer_schema_is_unsupported(run_dir):
    atomic_write_json(run_dir / "training_state.json", {"schema_version": 2, "status": "running"})
    r = read_once(run_dir)
    assert r.kind == "unsupported" and "upgrade apr" in r.problem and r.state is None


def test_a_folder_in_place_of_the_file_is_unreadable(run_dir):
    (run_dir / "training_state.json").mkdir()
    assert read_once(run_dir).kind == "unreadable"


def test_missing_and_wrongly_typed_fields_become_none():
    state, missing = normalize(
        {
            "schema_version": 1,
            "step": "twelve",
            "loss": float("nan"),
            "lr": True,
            "gpu": "RTX",
            "alerts": [{"step": 3, "condition": "loss > 10"}, "junk"],
            "loss_history": [[1, 2.0], ["x", 1], [2], [3, None], [4, 1.5]],
        }
    )
    assert state["step"] is None and state["loss"] is None and state["lr"] is None and state["gpu"] is None
    assert state["status"] == "unknown"
    assert state["alerts"] == [{"time": None, "step": 3, "condition": "loss > 10", "severity": None, "action": None,
                                "message": None}]
    assert state["loss_history"] == ((1, 2.0), (4, 1.5))
    assert "status" in missing and "heartbeat" in missing and "step" not in missing


def test_poll_rereads_only_when_the_file_changed(run_dir):
    path = copy_fixture("mid_run", run_dir)
    reader = StateReader(run_dir)
    assert reader.poll() is True and reader.reads == 1
    for _ in range(5):
        assert reader.poll() is False
    assert reader.reads == 1  # an unchanged file costs a stat, not a parse
    doc = json.loads(path.read_text())
    doc["step"] += 1
    atomic_write_json(path, doc)
    assert reader.poll() is True and reader.reads == 2
    assert reader.state["step"] == 12_848


def test_last_good_state_is_kept_through_a_bad_write(run_dir):
    path = copy_fixture("mid_run", run_dir)
    reader = StateReader(run_dir)
    reader.poll()
    path.write_text('{"schema_version": 1, "st')
    assert reader.poll() is True
    assert reader.reading.kind == "malformed"
    assert reader.state["step"] == 12_847  # still the last good state
    os.unlink(path)
    reader.poll()
    assert reader.reading.kind == "missing" and reader.state["step"] == 12_847


def test_reader_waits_for_a_file_that_appears_later(run_dir):
    reader = StateReader(run_dir)
    reader.poll()
    assert reader.reading.kind == "missing" and reader.state is None
    assert reader.poll() is False
    copy_fixture("starting", run_dir)
    assert reader.poll() is True and reader.state["status"] == "starting"


def test_stale_threshold_floor_refresh_and_writer_period():
    assert stale_threshold(1.0) == STALE_FLOOR_S == 120.0
    assert stale_threshold(30.0) == 300.0
    assert stale_threshold(1.0, {"log_period_s": 20.0}) == 200.0


def test_the_monitor_reads_what_the_tracker_writes():
    """The monitor keeps its own copy of the format (it must read files of other apr versions);
    the copy must agree with the writer."""
    from apr.monitor import state as mon
    from apr.track import state as track

    assert (mon.STATE_FILE, mon.SCHEMA_VERSION, mon.HISTORY_KEYS) == (
        track.STATE_FILE, track.SCHEMA_VERSION, track.HISTORY_KEYS)
    assert mon.ACTIVE_STATUSES == track.ACTIVE_STATUSES
    assert set(mon.KNOWN_STATUSES) == set(track.STATUSES)
    assert mon.STALE_FLOOR_S == track.STALE_AFTER_S
    written = set(track.RunState().fields) - {"schema_version"}
    assert written == set(mon._FIELD_KINDS) | set(mon._OPTIONAL_FIELDS)
    for now, state in ((1000.0, {"status": "running", "heartbeat": 800.0, "log_period_s": 1.0}),
                       (1000.0, {"status": "running", "heartbeat": 950.0}),
                       (5000.0, {"status": "running", "heartbeat": 1000.0, "log_period_s": 300.0})):
        assert mon.effective_status(state, now, mon.stale_threshold(0.1, state)) == track.effective_status(
            state, now)


def test_a_mixture_of_experts_routing_figures_are_read_and_malformed_ones_dropped():
    from apr.monitor.state import normalize

    doc = {"status": "running", "step": 20, "heartbeat": 1.0,
           "moe": {"step": 20, "moe_balance_loss": 1.02, "moe_expert_load": [0.3, 0.2, 0.25, 0.25],
                   "moe_max_expert_load": 0.3}}
    state, _ = normalize(doc)
    assert state["moe"] == {"step": 20, "moe_balance_loss": 1.02, "moe_expert_load": (0.3, 0.2, 0.25, 0.25),
                            "moe_max_expert_load": 0.3}
    assert normalize({**doc, "moe": "broken"})[0]["moe"] is None
    assert normalize({**doc, "moe": {"moe_balance_loss": "nan?"}})[0]["moe"]["moe_balance_loss"] is None


def test_effective_status_marks_old_heartbeats_of_active_runs_only():
    running = {"status": "running", "heartbeat": FIXTURE_NOW - 10}
    assert effective_status(running, FIXTURE_NOW, 30.0) == "running"
    assert effective_status(running, FIXTURE_NOW + 100, 30.0) == "stale"
    starting = {"status": "starting", "heartbeat": FIXTURE_NOW - 100}
    assert effective_status(starting, FIXTURE_NOW, 30.0) == "stale"
    finished = {"status": "finished", "heartbeat": FIXTURE_NOW - 10_000}
    assert effective_status(finished, FIXTURE_NOW, 30.0) == "finished"
    assert effective_status({"status": "running", "heartbeat": None}, FIXTURE_NOW, 30.0) == "running"


@pytest.mark.parametrize("name, expected", [("mid_run", "running"), ("stale", "stale"), ("failed", "failed")])
def test_fixture_statuses_at_the_fixture_clock(name, expected):
    state = read_once(FIXTURES / name).state
    assert effective_status(state, FIXTURE_NOW, stale_threshold(1.0, state)) == expected


def test_a_fifo_or_device_in_place_of_the_file_is_unreadable_without_hanging(run_dir):
    import os

    os.mkfifo(run_dir / "training_state.json")
    reading = read_once(run_dir)  # would block forever in open() on a FIFO
    assert reading.kind == "unreadable" and "FIFO" in reading.problem
    (run_dir / "training_state.json").unlink()
    (run_dir / "training_state.json").symlink_to("/dev/zero")
    reading = read_once(run_dir)
    assert reading.kind == "unreadable" and "device" in reading.problem


def test_deeply_nested_state_is_malformed(run_dir):
    (run_dir / "training_state.json").write_text('{"schema_version": 1, "x": ' + "[" * 100 + "]" * 100 + "}")
    reading = read_once(run_dir)
    assert reading.kind == "malformed" and "levels deep" in reading.problem


def _gone_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_active_run_of_this_host_whose_trainer_is_gone_is_dead_at_once():
    import os
    import socket

    gone = {"status": "running", "heartbeat": FIXTURE_NOW - 1, "host": socket.gethostname(), "pid": _gone_pid()}
    assert effective_status(gone, FIXTURE_NOW, 30.0) == "dead"  # a fresh heartbeat: not stale, yet dead
    assert effective_status({**gone, "status": "starting"}, FIXTURE_NOW, 30.0) == "dead"
    assert effective_status({**gone, "pid": os.getpid()}, FIXTURE_NOW, 30.0) == "running"
    assert effective_status({**gone, "host": "gpu-box"}, FIXTURE_NOW, 30.0) == "running"  # cannot be checked here
    assert effective_status({**gone, "status": "finished"}, FIXTURE_NOW, 30.0) == "finished"
