"""`apr monitor --json [--follow]`: the library (fake clock) and the CLI (CliRunner)."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.errors import AprError
from apr.fsutil import atomic_write_json
from apr.monitor.jsonmon import FORMAT_VERSION, follow, snapshot

from .conftest import FIXTURE_NOW, FIXTURES, copy_fixture, make_registry

RECORD_KEYS = {"format_version", "run_dir", "status", "stale", "heartbeat_age_s", "stale_after_s", "problem",
               "missing_fields", "state", "forecast"}
runner = CliRunner()


@pytest.mark.parametrize("name, status", [("starting", "starting"), ("mid_run", "running"), ("finished", "finished"),
                                          ("failed", "failed"), ("stale", "stale")])
def test_snapshot_of_each_recorded_state(name, status):
    doc = snapshot(FIXTURES / name, now=FIXTURE_NOW)
    assert set(doc) == RECORD_KEYS
    assert doc["format_version"] == FORMAT_VERSION == "1"
    assert doc["status"] == status and doc["stale"] is (status == "stale")
    assert doc["problem"] is None and doc["missing_fields"] == []
    assert doc["stale_after_s"] == 120.0
    on_disk = json.loads((FIXTURES / name / "training_state.json").read_text())
    assert doc["state"] == on_disk  # the file as written, not the monitor's normalised copy
    assert doc["heartbeat_age_s"] == pytest.approx(FIXTURE_NOW - on_disk["heartbeat"])


def test_the_forecast_needs_four_validations_and_a_run_not_yet_at_its_end():
    mid = snapshot(FIXTURES / "mid_run", now=FIXTURE_NOW, include_history=False)
    state = json.loads((FIXTURES / "mid_run" / "training_state.json").read_text())
    f = mid["forecast"]
    assert f["step"] == state["total_steps"] and f["points"] == len(state["val_loss_history"])
    assert f["low"] < f["loss"] < f["high"] and f["loss"] < state["val_loss"]  # the val curve still falls
    assert snapshot(FIXTURES / "failed", now=FIXTURE_NOW)["forecast"] is None  # 3 validations
    assert snapshot(FIXTURES / "finished", now=FIXTURE_NOW)["forecast"] is None  # at its last step


def test_snapshot_without_histories_and_of_a_missing_state(run_dir):
    doc = snapshot(FIXTURES / "mid_run", now=FIXTURE_NOW, include_history=False)
    assert not [k for k in doc["state"] if k.endswith("_history")]
    assert doc["state"]["step"] == 12_847
    with pytest.raises(AprError) as e:
        snapshot(run_dir)
    assert e.value.findings[0].code == "monitor.state_missing"
    (run_dir / "training_state.json").write_text("{")
    with pytest.raises(AprError) as e:
        snapshot(run_dir)
    assert e.value.findings[0].code == "monitor.state_malformed"


class Script:
    """A fake clock whose every sleep applies the next scripted change to the run directory."""

    def __init__(self, run_dir, changes):
        self.run_dir = run_dir
        self.changes = list(changes)
        self.now = FIXTURE_NOW
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.changes:
            self.changes.pop(0)(self.run_dir)


def _write(**fields):
    def apply(run_dir):
        path = run_dir / "training_state.json"
        doc = json.loads(path.read_text())
        doc.update(fields)
        atomic_write_json(path, doc)

    return apply


def test_follow_emits_once_per_change_and_ends_with_the_run(run_dir):
    def nothing(_):
        return None

    changes = [
        nothing,  # still no file: nothing new to say
        lambda d: copy_fixture("starting", d),
        nothing,  # unchanged: no line
        _write(status="running", step=1, heartbeat=FIXTURE_NOW + 2),
        _write(step=2, heartbeat=FIXTURE_NOW + 3),
        lambda d: (d / "training_state.json").write_text("{"),  # a torn write by a foreign writer
        lambda d: copy_fixture("finished", d),
    ]
    script = Script(run_dir, changes)
    lines = []
    reason, last = follow(run_dir, lines.append, 1.0, None, False, clock=script.clock, sleep=script.sleep)
    assert reason == "ended" and last["status"] == "finished"
    kinds = [(r["problem"] or {}).get("kind") or r["status"] for r in lines]
    assert kinds == ["missing", "starting", "running", "running", "malformed", "finished"]
    assert [r["state"]["step"] for r in lines if r["state"] and r["status"] == "running"] == [1, 2]
    assert all(set(r) == RECORD_KEYS for r in lines)
    assert all(not k.endswith("_history") for r in lines if r["state"] for k in r["state"])


def test_follow_reports_a_run_turning_stale_and_times_out(run_dir):
    copy_fixture("mid_run", run_dir)  # heartbeat 1.5 s before FIXTURE_NOW
    script = Script(run_dir, [])
    lines = []
    reason, last = follow(run_dir, lines.append, 10.0, 300.0, clock=script.clock, sleep=script.sleep)
    assert reason == "timeout"
    assert [r["status"] for r in lines] == ["running", "stale"]  # stale once the heartbeat is > 120 s old
    assert lines[1]["heartbeat_age_s"] > 120.0 and lines[1]["stale"] is True
    assert script.now - FIXTURE_NOW == pytest.approx(300.0)  # the last sleep is cut to the timeout


# ------------------------------------------------------------------------------------------- CLI


def test_cli_json_prints_one_object():
    result = runner.invoke(app, ["monitor", "--json", str(FIXTURES / "finished")])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "finished" and doc["state"]["status_reason"] == "reached max_steps"
    assert "loss_history" in doc["state"]
    result = runner.invoke(app, ["monitor", "--json", "--no-history", str(FIXTURES / "finished")])
    assert "loss_history" not in json.loads(result.stdout)["state"]


def test_cli_follow_on_an_ended_run_prints_one_line_and_exits_0():
    result = runner.invoke(app, ["monitor", "--json", "--follow", "--refresh", "50", str(FIXTURES / "failed")])
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["status"] == "failed"


def test_cli_follow_times_out_on_a_run_that_never_starts(run_dir):
    result = runner.invoke(app, ["monitor", "--json", "--follow", "--refresh", "50", "--timeout", "0.3",
                                 str(run_dir)])
    assert result.exit_code == 1
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["problem"]["kind"] == "missing"
    assert "timed out after 0.3 s" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("content, needle", [(None, "does not exist yet"), ("{", "not valid JSON"),
                                             ('{"schema_version": 9}', "upgrade apr")])
def test_cli_json_without_a_readable_state_exits_1(run_dir, content, needle):
    if content is not None:
        (run_dir / "training_state.json").write_text(content)
    result = runner.invoke(app, ["monitor", "--json", str(run_dir)])
    assert result.exit_code == 1
    assert result.output.startswith("error[monitor.state_") and f" {run_dir}/" in result.output  # which run
    assert needle in result.output and "Traceback" not in result.output
    assert result.stdout == ""


def test_cli_usage_errors(run_dir):
    result = runner.invoke(app, ["monitor", "--follow", str(run_dir)])
    assert result.exit_code == 2 and "--follow needs --json" in result.output
    result = runner.invoke(app, ["monitor", "--json", "--follow"])
    assert result.exit_code == 2 and "--follow needs a RUN_DIR" in result.output
    result = runner.invoke(app, ["monitor", "--json", "--refresh", "10", str(run_dir)])
    assert result.exit_code == 2


def test_cli_without_a_run_lists_the_active_runs(tmp_path, _private_apr_home):
    result = runner.invoke(app, ["monitor", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["active_runs"] == [] and "no registry" in doc["notes"][0]
    result = runner.invoke(app, ["monitor"])
    assert result.exit_code == 1 and "no active runs to monitor" in result.output

    live = tmp_path / "live"
    copy_fixture("mid_run", live)
    doc = json.loads((live / "training_state.json").read_text())
    doc["heartbeat"] = time.time()
    atomic_write_json(live / "training_state.json", doc)
    make_registry(_private_apr_home / "experiments.db", [
        {"id": "r1", "experiment": "albor", "status": "running", "output_dir": str(live), "started": 1.0}])
    result = runner.invoke(app, ["monitor", "--json"])
    (run,) = json.loads(result.stdout)["active_runs"]
    assert (run["run_id"], run["output_dir"], run["step"]) == ("20261118-194000-a1b2c3", str(live), 12_847)
