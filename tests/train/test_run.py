"""The run loop: step counts, exact resume, signals, alerts, records, refusing to mix runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from run_helpers import config_doc, make_dataset, signal_at
from safetensors.torch import load_file

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.build import resolve_config
from apr.train.run import ApplyOptions, prepare_run


def _run(root, *, resume=None, force=False, echo=None, **sections):
    cfg = AprConfig.model_validate(config_doc(root, **sections))
    lines: list[str] = []
    opts = ApplyOptions(resume=resume, force=force, echo=echo or lines.append)
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml", options=opts)
    result = run.execute()
    return result, run, getattr(echo, "lines", lines)


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("accum", "epochs", "max_steps", "expected"), [
    (1, 1, None, 24),  # 96 rows / 4 = 24 steps per epoch
    (2, 2, None, 24),  # 96 / 8 = 12 per epoch, 2 epochs
    (3, 1, 100, 8),  # max_steps capped by the data: 96 / 12 = 8
    (1, 3, 5, 5),
])
def test_runs_exactly_the_step_algebras_steps(root, accum, epochs, max_steps, expected):
    result, run, _ = _run(root, training={"gradient_accumulation": accum, "epochs": epochs, "max_steps": max_steps,
                                          "save_interval": 1000, "eval_interval": 0})
    assert result.status == "finished" and result.exit_code == 0
    assert result.total_steps == expected == result.final_step
    assert run.engine.optimizer_steps == expected
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "finished" and state["step"] == expected and state["total_steps"] == expected


def test_a_run_writes_its_records_and_the_validation_loss_falls(root):
    result, _, lines = _run(root, training={"max_steps": 24, "epochs": 3, "eval_interval": 8})
    run_dir = root / "run"
    assert (run_dir / "config.yaml").is_file() and (run_dir / ".apr" / "experiments.db").is_file()
    assert (run_dir / "checkpoint-step-24.json").is_file() and (run_dir / "checkpoint-best.json").is_file()
    assert result.first_val_loss is not None and result.val_loss < 0.7 * result.first_val_loss
    state = json.loads((run_dir / "training_state.json").read_text())
    assert state["last_checkpoint"]["step"] == 24
    assert [s for s, _ in state["val_loss_history"]] == [0, 8, 16, 24]
    assert any(line.startswith("step 24/24  loss") for line in lines)


def test_resume_from_a_middle_checkpoint_ends_bitwise_equal(root, tmp_path_factory):
    full, _, _ = _run(root)
    assert full.final_step == 12
    final = load_file(str(root / "run" / "checkpoint-step-12.safetensors"))

    other = tmp_path_factory.mktemp("resumed")
    (other / "run").mkdir()
    for suffix in ("json", "safetensors"):
        shutil.copy(root / "run" / f"checkpoint-step-4.{suffix}", other / "run" / f"checkpoint-step-4.{suffix}")
    resumed, run, lines = _run(root, resume="latest", training={"output_dir": str(other / "run")})
    assert run.start_step == 4 and resumed.final_step == 12
    assert any("training.output_dir" in line for line in lines)  # the harmless change is listed
    again = load_file(str(other / "run" / "checkpoint-step-12.safetensors"))
    assert set(again) == set(final)
    for name, tensor in final.items():
        assert again[name].equal(tensor), name


def test_resume_refuses_a_breaking_config_change_unless_forced(root):
    _run(root, training={"max_steps": 4})
    with pytest.raises(AprError, match="break an exact resume") as err:
        _run(root, resume="latest", training={"max_steps": 8}, optimizer={"lr": 5e-3})
    assert any(f.path == "optimizer.lr" for f in err.value.findings)
    result, run, _ = _run(root, resume="latest", force=True, training={"max_steps": 8}, optimizer={"lr": 5e-3})
    assert run.start_step == 4 and result.final_step == 8


def test_a_second_apply_into_a_used_output_dir_is_refused(root):
    _run(root, training={"max_steps": 4})
    with pytest.raises(AprError, match="already holds checkpoints") as err:
        _run(root, training={"max_steps": 4})
    assert err.value.findings[0].path == "training.output_dir"


def test_sigint_finishes_the_step_checkpoints_and_exits_130(root):
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under a background job
    echo = signal_at("step  6/12  loss")
    result, _, lines = _run(root, echo=echo, training={"log_interval": 1})
    assert result.status == "stopped" and result.exit_code == 130
    assert result.final_step == 6 and result.last_checkpoint.name == "checkpoint-step-6.json"
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "stopped" and "SIGINT" in state["status_reason"]
    # and the stopped run continues to the end
    resumed, run, _ = _run(root, resume="latest", training={"log_interval": 1})
    assert run.start_step == 6 and resumed.final_step == 12 and resumed.status == "finished"
    assert signal.getsignal(signal.SIGINT) is before  # the run put the handler back


def test_sigterm_exits_143(root):
    result, _, _ = _run(root, echo=signal_at("step  2/12  loss", signal.SIGTERM))
    assert result.exit_code == 143 and result.final_step == 2


def test_a_stop_alert_ends_the_run_with_a_checkpoint(root):
    result, _, _ = _run(root, monitoring={"alerts": [{"condition": "step >= 4", "action": "stop",
                                                       "message": "enough"}]})
    assert result.status == "stopped" and result.exit_code == 1 and "enough" in result.reason
    assert result.final_step == 4 and (root / "run" / "checkpoint-step-4.json").is_file()


def test_a_critical_alert_stops_at_once_and_keeps_the_last_checkpoint_the_newest(root):
    """severity critical: the state the alert fires on is not written; the newest checkpoint is the
    last periodic one, which a resume starts from."""
    result, _, lines = _run(root, training={"save_interval": 2, "log_interval": 1}, monitoring={"alerts": [
        {"condition": "step >= 3", "severity": "critical", "message": "diverged"}]})
    assert result.status == "stopped" and result.exit_code == 1 and "diverged" in result.reason
    assert "no checkpoint written" in result.reason and result.final_step == 3
    assert (root / "run" / "checkpoint-step-2.json").is_file()
    assert not (root / "run" / "checkpoint-step-3.json").exists()


def test_a_critical_alert_on_val_loss_stops_at_the_validation_before_its_checkpoint(root):
    """The alert is judged at the evaluation that met it, not one log interval later: the run stops
    at the validation step, writes no checkpoint of it, and keeps the last periodic one."""
    result, _, lines = _run(root, training={"save_interval": 2, "eval_interval": 4, "log_interval": 5,
                                            "max_steps": 8},
                            monitoring={"alerts": [{"condition": "val_loss > 0.0", "severity": "critical",
                                                    "message": "val diverged"}]})
    assert result.status == "stopped" and result.exit_code == 1 and "val diverged" in result.reason
    assert result.final_step == 4 and "no checkpoint written" in result.reason
    assert (root / "run" / "checkpoint-step-2.json").is_file()
    assert not (root / "run" / "checkpoint-step-4.json").exists()
    assert any(line.startswith("alert (critical) at step 4: val diverged") for line in lines)


def test_too_little_data_for_one_step_is_a_clear_error(root):
    with pytest.raises(AprError, match="fewer than one optimizer step"):
        _run(root, data={"batch_size": 64}, training={"gradient_accumulation": 2})


def test_warn_alerts_are_printed_and_the_run_goes_on(root):
    result, _, lines = _run(root, training={"max_steps": 6}, monitoring={"alerts": [
        {"condition": "step == 4", "action": "warn", "message": "halfway"}]})
    assert result.status == "finished" and result.final_step == 6
    assert any(line.startswith("alert (warning) at step 4") and "halfway" in line for line in lines)


def test_best_checkpoint_must_beat_the_initial_weights(root):
    # lr 0: the loss never changes, so no evaluation is better than step 0's
    result, run, _ = _run(root, optimizer={"lr": 1e-12, "min_lr": 0.0}, training={"max_steps": 8})
    assert result.status == "finished" and run.best_val == result.first_val_loss
    assert not (root / "run" / "checkpoint-best.json").exists()


def test_a_second_signal_stops_at_once_and_records_it(root):
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("step  3/12  loss"):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # raises in this frame: the loop unwinds at once

    result, _, _ = _run(root, echo=echo, training={"log_interval": 1})
    assert result.status == "stopped" and result.exit_code == 130 and "second SIGINT" in result.reason
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "stopped" and "second SIGINT" in state["status_reason"]
    assert not (root / "run" / "checkpoint-step-3.json").exists()  # no checkpoint: it stopped at once


def test_the_state_file_shows_the_step_a_signal_stopped_at(root):
    result, _, _ = _run(root, echo=signal_at("step  4/12  loss", signal.SIGTERM), training={"log_interval": 4})
    assert result.final_step == 4
    # the signal arrives during logging at step 4: the state, the checkpoint and the summary agree
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["step"] == 4 and state["last_checkpoint"]["step"] == 4


def test_forced_resume_with_another_batch_size_remaps_the_data_cursor(root):
    _run(root, training={"max_steps": 6, "eval_interval": 0})  # 24 micro-batches per epoch, stopped at 6
    result, run, lines = _run(root, resume="latest", force=True, data={"batch_size": 8},
                              training={"max_steps": 9, "eval_interval": 0})
    assert run.start_step == 6 and result.final_step == 9 and result.status == "finished"
    assert any("re-mapped" in line for line in lines)
    assert run.loader.epoch == 0 and run.loader.position == 3 + 3  # 6/24 of an epoch = 3 of 12, then 3 steps


def test_a_refused_resume_names_the_overrides_the_run_was_started_with(root):
    cfg = AprConfig.model_validate(config_doc(root, training={"max_steps": 4, "seed": 5}))
    opts = ApplyOptions(echo=lambda line: None, overrides={"seed": 5})
    prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                options=opts).execute()
    with pytest.raises(AprError, match="started with --seed 5"):
        _run(root, resume="latest", training={"max_steps": 8})


def test_resuming_with_another_model_shows_the_config_diff(root):
    _run(root, training={"max_steps": 2})
    with pytest.raises(AprError, match="another model") as err:
        _run(root, resume="latest", force=True, training={"max_steps": 4},
             model={"architecture": {"hidden_size": 64}})
    assert "hidden_size: 32 -> 64" in str(err.value)
    assert any(f.path == "model.architecture.hidden_size" for f in err.value.findings)


def _records(root) -> dict:
    """Everything a run records: the state file's bytes and a dump of both stores."""
    import sqlite3

    out = {"state": (root / "run" / "training_state.json").read_bytes()}
    for name, db in (("local", root / "run" / ".apr" / "experiments.db"),
                     ("global", Path(os.environ["APR_HOME"]) / "experiments.db")):
        conn = sqlite3.connect(db)
        try:
            out[name] = list(conn.iterdump())
        finally:
            conn.close()
    return out


def test_resuming_a_finished_run_says_so_and_rewrites_nothing(root):
    first, _, _ = _run(root, training={"max_steps": 8})
    assert first.status == "finished"
    before = _records(root)
    config_mtime = (root / "run" / "config.yaml").stat().st_mtime_ns
    result, run, lines = _run(root, resume="latest", training={"max_steps": 8})
    assert result.exit_code == 0 and result.status == "finished" and result.final_step == 8
    assert any("already finished" in line and "8 of 8" in line for line in lines)
    assert not any("resuming at step" in line for line in lines)
    assert _records(root) == before
    assert (root / "run" / "config.yaml").stat().st_mtime_ns == config_mtime


def test_raising_max_steps_continues_a_finished_run_and_keeps_its_records(root):
    _run(root, training={"max_steps": 8})
    old = json.loads((root / "run" / "training_state.json").read_text())
    result, run, lines = _run(root, resume="latest", training={"max_steps": 12})
    assert run.start_step == 8 and result.final_step == 12 and result.status == "finished"
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["run_id"] == old["run_id"] and state["started_at"] == old["started_at"]
    assert [s for s, _ in state["val_loss_history"]] == [0, 4, 8, 12]
    assert state["loss_history"][: len(old["loss_history"])] == old["loss_history"]
    assert state["elapsed_s"] > old["elapsed_s"]
    import sqlite3

    for db in (root / "run" / ".apr" / "experiments.db", Path(os.environ["APR_HOME"]) / "experiments.db"):
        conn = sqlite3.connect(db)
        statuses = [s for (s,) in conn.execute("SELECT status FROM status_history ORDER BY rowid")]
        steps = {s for (s,) in conn.execute("SELECT step FROM metrics WHERE key = 'val_loss'")}
        conn.close()
        assert statuses[:3] == ["starting", "running", "finished"] and statuses[-1] == "finished"
        assert steps == {0, 4, 8, 12}


def test_a_checkpoint_beyond_the_configs_last_step_is_refused(root):
    _run(root, training={"max_steps": 8})
    before = _records(root)
    with pytest.raises(AprError, match="step 8.*6 steps") as err:
        _run(root, resume="latest", training={"max_steps": 6})
    assert err.value.findings[0].path == "training.max_steps"
    assert _records(root) == before
