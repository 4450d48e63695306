"""Discovery of active runs (`apr monitor` without a run) and the dashboard's settings."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from apr.fsutil import atomic_write_json
from apr.monitor.discover import find_active_runs
from apr.monitor.settings import DEFAULT_REFRESH_MS, MIN_REFRESH_MS, load_settings

from .conftest import FIXTURE_NOW, copy_fixture, make_registry, tiny_config


def _state(run_dir, name="mid_run", **fields):
    path = copy_fixture(name, run_dir)
    doc = json.loads(path.read_text())
    doc.update(fields)
    atomic_write_json(path, doc)
    return run_dir


def test_only_runs_with_a_fresh_heartbeat_are_active(tmp_path):
    now = FIXTURE_NOW
    fresh = _state(tmp_path / "fresh", heartbeat=now - 5, run_id="fresh-run")
    older = _state(tmp_path / "older", heartbeat=now - 10, run_id="older-run", step=3)
    dead = _state(tmp_path / "dead", heartbeat=now - 3600)
    ended = _state(tmp_path / "ended", "finished")
    db = make_registry(tmp_path / "home" / "experiments.db", [
        {"id": "a", "experiment": "e", "status": "running", "output_dir": str(fresh), "started": 5.0},
        {"id": "b", "experiment": "e", "status": "running", "output_dir": str(older), "started": 4.0},
        {"id": "c", "experiment": "e", "status": "running", "output_dir": str(dead), "started": 3.0},
        {"id": "d", "experiment": "e", "status": "running", "output_dir": str(ended), "started": 2.0},
        {"id": "e", "experiment": "e", "status": "finished", "output_dir": str(fresh), "started": 1.0},
        {"id": "f", "experiment": "e", "status": "running", "output_dir": str(tmp_path / "gone"), "started": 0.5},
        {"id": "g", "experiment": "e", "status": "starting", "output_dir": str(fresh) + "/", "started": 0.1},
    ])
    found = find_active_runs(db, now=now)
    assert [r.run_id for r in found.runs] == ["fresh-run", "older-run"]  # newest first, one per folder
    run = found.runs[1]
    assert (run.status, run.step, run.total_steps, run.heartbeat_age_s) == ("running", 3, 19_073, 10.0)
    assert "older-run · step 3/19,073, heartbeat 10s ago" in run.describe()
    assert found.notes == []


def test_a_registry_that_is_missing_foreign_or_locked_is_a_note_not_an_error(tmp_path):
    found = find_active_runs(tmp_path / "none.db")
    assert found.runs == [] and "no registry at" in found.notes[0]
    foreign = tmp_path / "foreign.db"
    sqlite3.connect(foreign).execute("CREATE TABLE t (x)").connection.close()
    assert "has no runs table" in find_active_runs(foreign).notes[0]
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database" * 100)
    assert "cannot read" in find_active_runs(junk).notes[0]


def test_a_run_recorded_by_the_tracker_is_discovered_while_it_runs(tmp_path, _private_apr_home):
    from apr.track.recorder import RunRecorder

    rec = RunRecorder(tmp_path / "run", tiny_config(), config_hash="h", total_steps=10, tokens_per_step=4,
                      experiment="disc", background=False)
    rec.start()
    rec.log_step(1, {"loss": 2.0})
    found = find_active_runs()  # $APR_HOME/experiments.db
    assert [(r.run_id, r.experiment, r.step) for r in found.runs] == [(rec.run_id, "disc", 1)]
    rec.finish("finished")
    assert find_active_runs().runs == []
    assert find_active_runs(now=time.time()).notes == []


def test_settings_come_from_the_option_then_the_run_config_then_defaults(tmp_path):
    assert load_settings(None).refresh_ms == DEFAULT_REFRESH_MS == 1000
    assert load_settings(tmp_path).source == "default"
    (tmp_path / "config.yaml").write_text(
        "monitoring:\n  terminal:\n    refresh_rate: 2500\n"
        "    charts:\n      - {type: loss_curve, metric: loss, window: 20, show_eta: false}\n")
    s = load_settings(tmp_path)
    assert (s.refresh_ms, s.ema_window, s.show_eta, s.source) == (2500, 20, False, "config.yaml")
    assert s.refresh_s == 2.5
    s = load_settings(tmp_path, refresh_ms=300)
    assert (s.refresh_ms, s.source, s.ema_window) == (300, "option", 20)
    assert load_settings(tmp_path, refresh_ms=1).refresh_ms == MIN_REFRESH_MS


@pytest.mark.parametrize("text", ["monitoring: [", "- a list", "monitoring:\n  terminal:\n    refresh_rate: fast\n",
                                  "monitoring:\n  terminal:\n    refresh_rate: -5\n    charts: nope\n"])
def test_a_bad_run_config_falls_back_to_defaults(tmp_path, text):
    (tmp_path / "config.yaml").write_text(text)
    s = load_settings(tmp_path)
    assert (s.refresh_ms, s.ema_window, s.show_eta) == (1000, None, True)
    if text == "monitoring: [":
        assert s.note and "config.yaml not used" in s.note


def test_a_run_of_this_host_whose_trainer_is_gone_is_not_active(tmp_path):
    import socket

    from .test_state import _gone_pid

    now = time.time()
    killed = _state(tmp_path / "killed", heartbeat=now - 1, host=socket.gethostname(), pid=_gone_pid())
    elsewhere = _state(tmp_path / "elsewhere", heartbeat=now - 1, host="gpu-box", pid=_gone_pid(), run_id="remote")
    db = make_registry(tmp_path / "home" / "experiments.db", [
        {"id": "k", "experiment": "e", "status": "running", "output_dir": str(killed), "started": 2.0},
        {"id": "r", "experiment": "e", "status": "running", "output_dir": str(elsewhere), "started": 1.0},
    ])
    found = find_active_runs(db, now=now)
    assert [r.run_id for r in found.runs] == ["remote"]
