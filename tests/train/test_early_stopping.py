"""Early stopping (training.early_stopping): a plateauing validation loss ends the run as its own
status reason, the best checkpoint survives keep_last, and validate/plan refuse settings it cannot act on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_helpers import config_doc, make_dataset, write_config

from apr.config import config_hash, load_config
from apr.config.schema import AprConfig
from apr.plan.build import build_plan, resolve_config
from apr.plan.validate import config_findings
from apr.train.earlystop import EarlyStopping
from apr.train.run import ApplyOptions, prepare_run


def test_patience_counts_validations_without_an_improvement_of_min_delta():
    es = EarlyStopping(patience=2, min_delta=0.1)
    assert es.observe(0, 5.0) is None
    assert es.observe(2, 4.95) is None  # better, but by less than min_delta: a wait
    assert es.observe(4, 4.8) is None  # improvement by 0.2: the wait restarts
    assert (es.best, es.best_step, es.waited) == (4.8, 4, 0)
    assert es.observe(6, 4.75) is None
    stop = es.observe(8, 4.9)
    assert stop is not None and (stop.status, stop.exit_code) == ("finished", 0)
    assert stop.reason.startswith("early stopping: ") and "best 4.8000 at step 4" in stop.reason
    restored = EarlyStopping(2, 0.1)
    restored.load_state_dict(es.state_dict())
    assert restored.state_dict() == es.state_dict()


def _run(tmp_path: Path, resume: str | None = None, **training):
    if resume is None:
        make_dataset(tmp_path, val_rows=4)
    cfg = AprConfig.model_validate(config_doc(tmp_path, optimizer={"lr": 0.1, "min_lr": 0.1}, training={
        "max_steps": 60, "warmup_steps": 0, "lr_scheduler": "constant", "log_interval": 2, "eval_interval": 2,
        "eval_batches": 1, "save_interval": 1000, "keep_last": 1, **training}))
    opts = ApplyOptions(echo=lambda line: None, resume=resume)
    return prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                       options=opts).execute()


def test_a_plateau_at_high_lr_ends_the_run_and_the_best_checkpoint_is_kept(tmp_path):
    result = _run(tmp_path, early_stopping={"patience": 3, "min_delta": 0.01})
    run = tmp_path / "run"
    state = json.loads((run / "training_state.json").read_text())
    assert (result.status, result.exit_code) == ("finished", 0)
    assert result.final_step < 60, "the plateau should have ended the run early"
    assert result.reason.startswith("early stopping: val_loss did not improve by 0.01 in 3 validations")
    assert (state["status"], state["status_reason"], state["step"]) == ("finished", result.reason, result.final_step)
    best = json.loads((run / "checkpoint-best.json").read_text())
    best_step = int(result.reason.split(" at step ")[1].split(";")[0])
    assert 0 < best["step"] == best_step < result.final_step
    # keep_last 1: only the last step checkpoint besides the best one
    assert sorted(p.name for p in run.glob("checkpoint-step-*.json")) == [f"checkpoint-step-{result.final_step}.json"]
    # the stop came exactly `patience` validations after the best one, none of them better by min_delta
    history = dict(state["val_loss_history"])
    after = [v for s, v in history.items() if s > best_step]
    assert history[best_step] == min(history.values()) and len(after) == 3
    assert all(v >= history[best_step] - 0.01 for v in after)


@pytest.mark.slow
def test_a_resumed_run_counts_on_from_its_checkpoint_and_stops_at_the_same_step(tmp_path):
    # uninterrupted, this run stops at step 20 (best at 14); cut at 16 (one wait counted) and resumed,
    # the wait must carry over: a fresh count would run on to step 22 at least
    first = _run(tmp_path, max_steps=16, early_stopping={"patience": 3, "min_delta": 0.01})
    assert (first.final_step, first.reason) == (16, None)
    resumed = _run(tmp_path, resume="latest", early_stopping={"patience": 3, "min_delta": 0.01})
    assert resumed.final_step == 20
    assert resumed.reason.startswith("early stopping: ") and "at step 14;" in resumed.reason


def _findings(tmp_path, **sections):
    make_dataset(tmp_path)
    return [f for f in config_findings(load_config(write_config(tmp_path, **sections)))
            if f.code == "config.early_stopping"]


@pytest.mark.parametrize("sections, got", [
    ({"data": {"val": None}}, "no data.val"),
    ({"training": {"eval_interval": 0}}, "training.eval_interval: 0"),
])
def test_validate_refuses_early_stopping_without_validation(tmp_path, sections, got):
    sections.setdefault("training", {})["early_stopping"] = {"patience": 2}
    (f,) = _findings(tmp_path, **sections)
    assert (f.severity, f.path, f.got) == ("error", "training.early_stopping.patience", got)
    assert f.file.endswith("cfg.yaml") and f.line is not None


def test_validate_refuses_patience_longer_than_the_run(tmp_path):
    (f,) = _findings(tmp_path, training={"max_steps": 12, "eval_interval": 4, "early_stopping": {"patience": 4}})
    assert (f.expected, f.got) == ("patience <= 3", "4")
    assert "12 steps validate 3 times" in f.message
    assert _findings(tmp_path, training={"max_steps": 12, "eval_interval": 4, "early_stopping": {"patience": 3}}) == []


def test_plan_refuses_patience_longer_than_the_run_it_counts_from_the_data(tmp_path):
    # no max_steps: validate cannot know the run's length, the plan counts it from the data
    make_dataset(tmp_path)  # 96 rows of batch 4 x 2 epochs: 48 steps, validated every 4: 12 times
    cfg = write_config(tmp_path, training={"max_steps": None, "early_stopping": {"patience": 13}})
    assert [f for f in config_findings(load_config(cfg)) if f.code == "config.early_stopping"] == []
    (f,) = [f for f in build_plan(cfg).findings if f.code == "config.early_stopping"]
    assert (f.severity, f.expected, f.got) == ("error", "patience <= 12", "13")
