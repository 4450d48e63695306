"""What `apr runs ls/show` print: formatted numbers, deleted checkpoints marked, control characters
escaped, damaged stores skipped with a warning (issue 24 items 7, 20, 21)."""

from __future__ import annotations

import json
import sqlite3

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.track.runs import list_runs

runner = CliRunner()


def _record(rec_factory, folder, run_id, experiment="exp", steps=3, checkpoints=()):
    rec = rec_factory(folder, experiment=experiment, background=False, run_id=run_id)
    rec.start()
    for s in range(1, steps + 1):
        rec.log_step(s, {"loss": 4.0 / s, "lr": 0.00010000000000000005, "epoch": 0.39867109634551495 * s,
                         "tokens_seen": 163840.0 * s})
    for step in checkpoints:
        path = folder / f"checkpoint-step-{step}.safetensors"
        path.write_bytes(b"x" * 10)
        rec.checkpoint(step, path)
    rec.finish("finished")
    return rec


@pytest.fixture
def two_runs(tmp_path, recorder_factory, monkeypatch):
    _record(recorder_factory, tmp_path / "runs" / "a", "20261122-000000-aaaa01", checkpoints=(1, 2))
    _record(recorder_factory, tmp_path / "runs" / "b", "20261122-000000-aaaa02")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_show_formats_numbers_and_marks_deleted_checkpoints(two_runs):
    (two_runs / "runs" / "a" / "checkpoint-step-1.safetensors").unlink()  # pruned
    result = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa01"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "0.39867109634551495" not in out and "0.00010000000000000005" not in out
    assert "1.19601" in out  # epoch at step 3, six significant digits
    assert "lr             0.0001 " in out
    assert "tokens_seen    491520 " in out  # an integral float prints as an integer (was 491520.0)
    lines = {line.split()[1]: line for line in out.splitlines() if line.strip().startswith("step ")
             and "sha256" in line}
    assert lines["1"].endswith("(deleted)")
    assert not lines["2"].endswith("(deleted)")
    doc = json.loads(runner.invoke(app, ["runs", "show", "20261122-000000-aaaa01", "--json"]).output)
    assert [c["exists"] for c in doc["checkpoints"]] == [False, True]


def _tamper(db, sql, *args):
    conn = sqlite3.connect(db)
    conn.execute(sql, args)
    conn.commit()
    conn.close()


@pytest.mark.parametrize("damage", [
    ("UPDATE runs SET started = ?", "yesterday"),
    ("UPDATE runs SET step = ?", "three"),
    ("DROP TABLE runs",),
])
def test_a_damaged_store_is_a_warning_and_the_others_are_listed(two_runs, damage):
    _tamper(two_runs / "runs" / "b" / ".apr" / "experiments.db", *damage)
    listing = list_runs()
    assert [r["run_id"] for r in listing.runs] == ["20261122-000000-aaaa01"]
    assert len(listing.warnings) == 1 and "runs/b/.apr/experiments.db" in listing.warnings[0]
    result = runner.invoke(app, ["runs", "ls"])
    assert result.exit_code == 0, result.output
    assert "aaaa01" in result.output and "warning:" in result.output and "Traceback" not in result.output
    shown = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa01"])
    assert shown.exit_code == 0, shown.output


def test_show_of_a_run_in_a_damaged_store_is_a_clear_error(two_runs):
    db = two_runs / "runs" / "a" / ".apr" / "experiments.db"
    _tamper(db, "DROP TABLE status_history")
    result = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa01"])
    assert result.exit_code == 1
    assert "error[" in result.output and str(db) in result.output and "Traceback" not in result.output


def test_control_characters_in_records_are_escaped(two_runs):
    db = two_runs / "runs" / "a" / ".apr" / "experiments.db"
    _tamper(db, "UPDATE runs SET output_dir = ?, status_reason = ?, host = ?",
            "/tmp/\x1b[2J\x1b]0;pwned\x07", "bye\x1b[2J", "h\x9bost")
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.execute("UPDATE experiments SET name = ?", ("ev\x1b[31mil",))
    conn.execute("UPDATE runs SET experiment = ?", ("ev\x1b[31mil",))
    conn.commit()
    conn.close()
    for args in (["runs", "ls"], ["runs", "show", "20261122-000000-aaaa01"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and "\x07" not in result.output and "\x9b" not in result.output
        assert "ev\\x1b[31mil" in result.output
    shown = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa01"]).output
    assert "/tmp/\\x1b[2J\\x1b]0;pwned\\x07" in shown and "h\\x9bost" in shown


def test_show_lists_the_config_tracking_tags(tmp_path, recorder_factory, monkeypatch):
    from track_helpers import make_config

    cfg = make_config(monitoring={"tracking": {"tags": {"stage": "pretrain", "data": "code-v2"}}})
    rec = recorder_factory(tmp_path / "runs" / "t", cfg=cfg, background=False, run_id="20261122-000000-aaaa09")
    rec.start()
    rec.finish("finished")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa09"])
    assert result.exit_code == 0, result.output
    assert "tags       stage=pretrain, data=code-v2" in result.output or \
        "tags       data=code-v2, stage=pretrain" in result.output
    doc = json.loads(runner.invoke(app, ["runs", "show", "20261122-000000-aaaa09", "--json"]).output)
    assert doc["tags"] == {"stage": "pretrain", "data": "code-v2"}


def test_show_prints_each_list_metric_with_its_values_and_summary(tmp_path, recorder_factory, monkeypatch):
    rec = recorder_factory(tmp_path / "runs" / "c", experiment="exp", background=False,
                           run_id="20261122-000000-aaaa03")
    rec.start()
    for s in (10, 20):
        rec.log_step(s, {"loss": 2.0, "block_grad_norm": [0.1 * s, 0.5 * s, 0.2 * s],
                         "block_update_norm": [0.01, 0.02, None], "max_block_grad_norm": 0.5 * s})
    rec.finish("finished")
    monkeypatch.chdir(tmp_path)
    out = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa03"]).output
    assert "block_grad_norm.1" not in out and "block_grad_norm[" not in out  # not one cryptic row per list
    lines = out.splitlines()
    i = next(n for n, line in enumerate(lines) if line.strip().startswith("block_grad_norm:"))
    assert lines[i].strip() == "block_grad_norm: 3 blocks at step 20; max 10 (block 1), min 2 (block 0), mean 5.33333"
    assert lines[i + 1].split() == ["block", "0:", "2", "block", "1:", "10", "block", "2:", "4"]  # every block
    j = next(n for n, line in enumerate(lines) if line.strip().startswith("block_update_norm:"))
    assert "max 0.02 (block 1), min 0.01 (block 0)" in lines[j] and lines[j].endswith("not finite: block 2")
    assert lines[j + 1].split() == ["block", "0:", "0.01", "block", "1:", "0.02", "block", "2:", "-"]
    assert "max_block_grad_norm" in out and "list metrics" in out
    doc = json.loads(runner.invoke(app, ["runs", "show", "20261122-000000-aaaa03", "--json"]).output)
    assert doc["final_metrics"]["block_grad_norm.1"]["value"] == 10.0  # JSON keeps every block


def test_a_long_list_wraps_in_order_and_any_indexed_metric_is_a_list():
    from apr.cli.cmd_runs import _split_lists, list_metric_lines

    final = {"loss": {"step": 5, "value": 2.0}, "eval.task.acc": {"step": 5, "value": 0.4}}
    final.update({f"block_grad_norm.{i}": {"step": 5, "value": 0.5 + i / 100} for i in range(24)})
    final.update({f"group_lr.{i}": {"step": 5, "value": 1e-3 * (i + 1)} for i in range(2)})
    scalars, lists = _split_lists(final)
    assert set(scalars) == {"loss", "eval.task.acc"} and list(lists) == ["block_grad_norm", "group_lr"]
    lines = list_metric_lines(lists)
    assert lines[0].startswith("  block_grad_norm: 24 blocks at step 5; max 0.73 (block 23), min 0.5 (block 0)")
    cells = " ".join(lines[1:5]).split()
    assert cells[1::3] == [f"{i}:" for i in range(24)] and cells[-1] == "0.73"  # 6 a line, in block order
    assert all(len(line.split()) == 18 for line in lines[1:5])
    assert lines[5] == "  group_lr: 2 values at step 5; max 0.002 (#1), min 0.001 (#0), mean 0.0015"
    assert lines[6].split() == ["#0:", "0.001", "#1:", "0.002"]


def test_show_counts_alerts_by_severity_and_names_each(tmp_path, recorder_factory, monkeypatch):
    from track_helpers import make_config

    alerts = [{"condition": "loss > 3.0", "severity": "info", "message": "still high"},
              {"condition": "loss > 3.5", "action": "stop", "message": "exploded"}]
    rec = recorder_factory(tmp_path / "runs" / "s", cfg=make_config(monitoring={"alerts": alerts}), background=False,
                           run_id="20261122-000000-aaaa07")
    rec.start()
    rec.log_step(1, {"loss": 4.0})
    rec.check_alerts({"loss": 4.0, "step": 1})
    rec.finish("stopped", "alert: exploded")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["runs", "show", "20261122-000000-aaaa07"])
    assert result.exit_code == 0, result.output
    assert "alerts: 1 error, 1 info" in result.stdout
    assert "step 1  info      still high (loss=4)" in result.stdout and "step 1  error     exploded" in result.stdout
    doc = json.loads(runner.invoke(app, ["runs", "show", "20261122-000000-aaaa07", "--json"]).stdout)
    assert doc["alert_counts"] == {"critical": 0, "error": 1, "warning": 0, "info": 1}
    assert [a["severity"] for a in doc["alerts"]] == ["info", "error"]
