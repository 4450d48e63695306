"""apr/train/csvlog.py: ``monitoring.csv_log`` writes ``metrics.csv`` as the run goes, one row per
logged or validated step, and a resume or a rollback leaves no step twice."""

from __future__ import annotations

import csv

import pytest
from run_helpers import make_dataset, write_config

from apr.apply import run_apply
from apr.errors import AprError
from apr.train.csvlog import CSV_LOG, HEADER, CsvLog

SECTIONS = {"monitoring": {"csv_log": True},
            "training": {"max_steps": 8, "log_interval": 2, "eval_interval": 4, "save_interval": 4}}


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _quiet(tmp_path) -> dict:
    return {"apr_home": tmp_path / "home", "echo": lambda line: None}


def test_a_run_writes_a_row_per_logged_or_validated_step(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    result = run_apply(write_config(tmp_path, **SECTIONS), **_quiet(tmp_path))
    rows = _rows(tmp_path / "run" / CSV_LOG)
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6, 8]
    assert [bool(r["val_loss"]) for r in rows] == [True, False, True, False, True]  # eval_interval 4, and step 0
    assert rows[0]["loss"] == ""  # step 0: the initial weights' validation only
    last = rows[-1]
    assert float(last["loss"]) == result.loss and float(last["val_loss"]) == result.val_loss
    assert int(last["tokens_seen"]) == 8 * 4 * 16 and float(last["lr"]) > 0 and float(last["grad_norm"]) > 0


def test_a_resume_drops_the_rows_past_its_checkpoint_and_continues_without_a_step_twice(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    cfg = write_config(tmp_path, **SECTIONS)
    run_apply(cfg, **_quiet(tmp_path))
    straight = _rows(tmp_path / "run" / CSV_LOG)
    # as if killed after step 8's rows but before its checkpoint, mid-way through writing a row
    for suffix in ("json", "safetensors"):
        (tmp_path / "run" / f"checkpoint-step-8.{suffix}").unlink()
    with open(tmp_path / "run" / CSV_LOG, "a") as f:
        f.write("10,3.2,")
    resumed = run_apply(cfg, resume="latest", **_quiet(tmp_path))
    assert resumed.start_step == 4
    again = _rows(tmp_path / "run" / CSV_LOG)
    assert [r["step"] for r in again] == [r["step"] for r in straight]
    # the resume is bitwise: the same losses; only the throughput differs
    keep = [k for k in straight[0] if k != "tokens_per_s"]
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in straight]


class _Inner:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append(name)


def test_a_rewind_drops_later_rows_and_a_fresh_run_starts_the_file_anew(tmp_path):
    log = CsvLog(_Inner(), tmp_path)
    log.start(None)
    for step in (2, 4, 6):
        log.log_step(step, {"loss": 1.0 / step, "lr": 0.1, "tokens_seen": step})
    log.log_eval(6, 0.5)
    log.rewind(4)  # a rollback to step 4's checkpoint
    log.log_step(6, {"loss": 0.25})
    log.finish("finished")
    rows = _rows(tmp_path / CSV_LOG)
    assert [(r["step"], r["loss"], r["val_loss"]) for r in rows] == [("2", "0.5", ""), ("4", "0.25", ""),
                                                                     ("6", "0.25", "")]
    assert log._inner.calls == ["start", "log_step", "log_step", "log_step", "log_eval", "rewind", "log_step",
                                "finish"]
    fresh = CsvLog(_Inner(), tmp_path)
    fresh.start(None)
    assert (tmp_path / CSV_LOG).read_text() == HEADER


def test_a_metrics_csv_of_the_users_is_refused_and_left_as_it_is(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    (tmp_path / "run").mkdir()
    mine = tmp_path / "run" / CSV_LOG
    mine.write_text("my,own,table\n")
    with pytest.raises(AprError, match="not a CSV log apr wrote") as err:
        run_apply(write_config(tmp_path, **SECTIONS), **_quiet(tmp_path))
    assert err.value.findings[0].path == "monitoring.csv_log"
    assert mine.read_text() == "my,own,table\n"
