"""Bad-step skipping and spike rollback: the engine's gate, the run loop's decisions, the ledger,
equality with a run whose data never held the bad window, resume in the middle of a rollback."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from apr.apply import run_apply
from apr.cli.main import app
from apr.monitor.state import normalize
from apr.monitor.view import messages
from apr.steps.resolved import resolve as plan_of
from apr.track.names import global_db_path, local_db_path
from apr.track.store import connect_readonly, events
from apr.train.badsteps import BadStepTest, RunningStats
from apr.train.build import build_engine
from apr.train.rollback import SpikeWatch
from tests.train.run_helpers import SEQ, VOCAB, write_config
from tests.train.tiny import batches, make_config

# ---------------------------------------------------------------------------------- the tests' data

BAD = range(80, 92)  # rows of steps 21-23 (batch 4, no accumulation, shuffle off)
SKIP_CFG = {"bad_steps": {"loss_z": 3, "window": 10, "min_history": 8}}
ROLLBACK_CFG = {"rollback": {"threshold": 1.2, "patience": 3, "window": 10, "min_history": 8}}


def _pattern(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    starts, strides = rng.integers(0, VOCAB, size=n), rng.integers(1, 4, size=n)
    return (starts[:, None] + strides[:, None] * np.arange(SEQ + 1)[None, :]) % VOCAB


def _write(folder: Path, rows: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    offsets = pa.array(np.arange(len(rows) + 1, dtype=np.int32) * (SEQ + 1))
    col = pa.ListArray.from_arrays(offsets, pa.array(rows.astype(np.uint32).reshape(-1)))
    pq.write_table(pa.table({"input_ids": col}), folder / "shard-00000.parquet")


def _corpus(root: Path, *, without_bad: bool = False) -> None:
    """Learnable rows with a window of random tokens (BAD), or the same rows with BAD left out."""
    rows = _pattern(200, 1)
    rows[BAD.start:BAD.stop] = np.random.default_rng(9).integers(0, VOCAB, size=(len(BAD), SEQ + 1))
    if without_bad:
        rows = np.delete(rows, list(BAD), axis=0)
    _write(root / "data" / "train", rows)
    _write(root / "data" / "val", _pattern(16, 2))


def _cfg(root: Path, max_steps: int, **training) -> Path:
    return write_config(root, data={"shuffle": False}, optimizer={"lr": 1e-2},
                        training={"max_steps": max_steps, "warmup_steps": 0, "lr_scheduler": "constant",
                                  "save_interval": 5, "log_interval": 5, "eval_interval": 0, "grad_clip": None,
                                  **training})


def _final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    weights = max(run_dir.glob("checkpoint-step-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return load_file(str(weights))


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "training_state.json").read_text())


def _apply(root: Path, cfg: Path, **kw):
    return run_apply(cfg, apr_home=root / "home", echo=lambda line: None, **kw)


# ------------------------------------------------------------------------------- detectors (units)


def test_running_stats_z_and_state():
    stats = RunningStats(window=9)
    for x in (1.0, 1.2, 0.8, 1.1, 0.9):
        stats.add(x)
    assert 0.9 < stats.mean < 1.1 and stats.var > 0
    assert stats.z(stats.mean) == 0.0 and stats.z(stats.mean + 2 * math.sqrt(stats.var)) == pytest.approx(2.0)
    copy = RunningStats(window=9)
    copy.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    assert copy.z(3.0) == stats.z(3.0)


def test_bad_step_test_flags_upward_outliers_only_after_its_history():
    test = BadStepTest(loss_z=3.0, grad_norm_z=None, window=20, min_history=5)
    assert test.verdict(50.0, None) is None  # no history yet: recorded, not judged
    test = BadStepTest(loss_z=3.0, grad_norm_z=3.0, window=20, min_history=5)
    for x in (2.0, 2.1, 1.9, 2.05, 1.95):
        assert test.verdict(x, 1.0 + x / 10) is None
    assert test.verdict(0.5, 1.2) is None  # far below: not a reason to skip
    v = test.verdict(4.0, 1.2)
    assert v is not None and v.what == "loss" and v.z > 3.0 and "no update" in v.message()
    v = test.verdict(2.0, 9.0)
    assert v is not None and v.what == "grad_norm"
    count = test.loss.count
    test.verdict(float("nan"), 1.0)  # the non-finite handling owns NaN: not judged, not recorded
    assert test.loss.count == count


def test_spike_watch_triggers_after_patience_and_forgives_a_short_spike():
    watch = SpikeWatch(threshold=1.5, patience=3, window=10, min_history=4)
    for step, loss in enumerate((2.0, 2.0, 2.0, 2.0), start=1):
        assert watch.observe(step, loss) is None
    assert watch.observe(5, 4.0) is None and watch.in_spike
    assert watch.observe(6, 2.1) is None and not watch.in_spike  # one high step: forgiven
    assert watch.observe(7, 4.0) is None and watch.observe(8, 4.0) is None
    assert watch.observe(9, float("nan")) == 7  # the window starts at the first spike step


# ------------------------------------------------------------------------------------ the engine


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.train_state_tensors().items()}


@pytest.mark.parametrize("training,gate_norm", [
    # one walk: the loss-only gate, before the head's update
    ({"grad_clip": None, "execution": {"gradients": "workspace"}}, False),
    ({"clip_mode": "global"}, True),  # norm pre-pass: the gate sees the exact norm
    ({"execution": {"gradients": "kept"}}, True),  # kept gradients
    ({"gradient_accumulation": 2}, True),
    ({"engine": "standard"}, True),
])
def test_a_flagged_step_changes_nothing_and_is_not_counted(training, gate_norm):
    config = make_config(training=training)
    accum = config.training.gradient_accumulation
    engine = build_engine(plan_of(config))
    data = batches(config, 3 * accum, seed=1)
    seen = []

    def gate(loss, norm):
        seen.append((float(loss), None if norm is None else float(norm)))
        return len(seen) == 2  # flag the second step

    engine.step_gate = gate
    engine.train_step(data[:accum], lr=1e-2)
    before, steps = _weights(engine), engine.optimizer_steps
    result = engine.train_step(data[accum:2 * accum], lr=1e-2)
    assert result.flagged and engine.optimizer_steps == steps
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and both moments untouched
    assert (seen[1][1] is not None) == gate_norm
    assert seen[1][0] == pytest.approx(float(result.loss))
    assert not engine.train_step(data[2 * accum:], lr=1e-2).flagged and engine.optimizer_steps == steps + 1


def test_the_gradient_norm_test_adds_a_norm_prepass_to_the_lean_walk():
    lean = make_config(training={"grad_clip": None, "execution": {"gradients": "workspace"}})
    tested = make_config(training={"grad_clip": None, "execution": {"gradients": "workspace"},
                                   "bad_steps": {"grad_norm_z": 6}})
    assert build_engine(plan_of(lean)).strategy.backward_walks == 1
    st = build_engine(plan_of(tested)).strategy
    assert st.backward_walks == 2 and "bad-step test" in st.describe()


# ------------------------------------------------------------------------------------- the run


def test_skipped_steps_leave_the_weights_of_a_run_that_never_saw_them(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "skip"
    _corpus(ref, without_bad=True)
    _corpus(run)
    assert _apply(ref, _cfg(ref, 27)).status == "finished"
    result = _apply(run, _cfg(run, 30, **SKIP_CFG))
    assert result.status == "finished" and result.final_step == 30
    events = [e for e in _state(run / "run")["events"] if e["kind"] == "bad_step"]
    assert [e["step"] for e in events] == [21, 22, 23]
    assert sorted(r["row"] for e in events for r in e["detail"]["rows"]) == list(BAD)
    assert all(e["detail"]["what"] == "loss" and e["detail"]["z"] > 3 for e in events)
    a, b = _final_tensors(ref / "run"), _final_tensors(run / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rollback_skips_the_window_and_ends_as_a_run_without_it(tmp_path, monkeypatch):
    ref, run = tmp_path / "ref", tmp_path / "rb"
    _corpus(ref, without_bad=True)
    _corpus(run)
    assert _apply(ref, _cfg(ref, 30)).status == "finished"
    result = _apply(run, _cfg(run, 30, **ROLLBACK_CFG))
    assert result.status == "finished" and result.final_step == 30
    state = _state(run / "run")
    (event,) = [e for e in state["events"] if e["kind"] == "rollback"]
    assert event["step"] == 23 and event["detail"]["restored_step"] == 20 and event["detail"]["steps"] == [21, 23]
    assert [(r["shard"], r["row"]) for r in event["detail"]["rows"]] == [("shard-00000.parquet", i) for i in BAD]
    a, b = _final_tensors(ref / "run"), _final_tensors(run / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)  # weights and AdamW moments, bitwise
    # the metrics of the abandoned steps were replaced by the replayed ones
    loss_steps = [p[0] for p in state["loss_history"]]
    assert loss_steps == sorted(set(loss_steps)) and max(p[1] for p in state["loss_history"] if p[0] > 20) < 4.0
    # both stores hold the event with its rows
    for db in (local_db_path(run / "run"), global_db_path(run / "home")):
        conn = connect_readonly(db)
        (stored,) = [e for e in events(conn, result.run_id) if e["kind"] == "rollback"]
        assert [r["row"] for r in stored["detail"]["rows"]] == list(BAD)
        conn.close()
    # the monitor's messages name it
    shown_state, _ = normalize(state)
    lines = [text for text, _style in messages(None, shown_state, "finished", 0.0, 60.0, limit=20)]
    assert "0 bad steps skipped, 1 rollbacks (apr runs ledger lists the rows)" in lines
    assert any(text.startswith("step 23 rollback 1/3") and text.endswith("[12 rows]") for text in lines)
    # runs show and the exported ledger
    monkeypatch.setenv("APR_HOME", str(run / "home"))
    shown = CliRunner().invoke(app, ["runs", "show", result.run_id, "--global"])
    assert shown.exit_code == 0 and "rollback 1/3" in shown.stdout and "[12 rows: apr runs ledger]" in shown.stdout
    out = tmp_path / "ledger.csv"
    r = CliRunner().invoke(app, ["runs", "ledger", result.run_id[:15], "--global", "--format", "csv", "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(out.open()))
    assert [(x["event"], x["shard"], int(x["row"])) for x in rows] == [("rollback", "shard-00000.parquet", i)
                                                                         for i in BAD]


def test_the_rollback_is_on_disk_before_it_is_reported(tmp_path, monkeypatch):
    """A kill right after "rollback 1/3" must resume past the window: so the rewritten checkpoint
    is written (not still on the background writer) before the run says it rolled back. The writer
    is slowed here so that a report that did not wait would find the old checkpoint."""
    import time

    from apr.checkpoint import background

    submit = background.BackgroundWriter.submit

    def slow_submit(self, step, is_best, write):
        def slow():
            time.sleep(0.3)
            return write()
        submit(self, step, is_best, slow)

    monkeypatch.setattr(background.BackgroundWriter, "submit", slow_submit)
    _corpus(tmp_path)
    seen = []

    def echo(line: str) -> None:
        if "rollback 1/" in line:
            meta = json.loads((tmp_path / "run" / "checkpoint-step-20.json").read_text())
            seen.append(json.dumps(meta))

    result = run_apply(_cfg(tmp_path, 25, **ROLLBACK_CFG), apr_home=tmp_path / "home", echo=echo)
    assert result.status == "finished" and len(seen) == 1
    assert '"rollbacks": 1' in seen[0] and '"skips": [{"at": 20, "count": 3}]' in seen[0]  # the decision and its skip


def test_too_many_rollbacks_stop_the_run_keeping_the_last_good_checkpoint(tmp_path):
    _corpus(tmp_path)  # patience 1: each bad step is a rollback of its own; the second is one too many
    cfg = _cfg(tmp_path, 30, rollback={**ROLLBACK_CFG["rollback"], "patience": 1, "max_rollbacks": 1})
    result = _apply(tmp_path, cfg)
    assert result.status == "failed" and result.exit_code == 1 and "max_rollbacks" in result.reason
    rollbacks = [e for e in _state(tmp_path / "run")["events"] if e["kind"] == "rollback"]
    assert [(e["step"], e["detail"]["steps"]) for e in rollbacks] == [(21, [21, 21])]
    assert max(int(p.stem.rsplit("-", 1)[1]) for p in (tmp_path / "run").glob("checkpoint-step-*.json")) == 20


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("training,path,code", [
    ({"save_interval": 1000, "rollback": {"threshold": 1.5}}, "training.rollback.threshold", "config.rollback"),
    ({"save_interval": 5, "rollback": {"threshold": 1.5, "patience": 30}}, "training.rollback.patience",
     "config.rollback"),
])
def test_a_rollback_that_could_never_act_fails_validate_and_plan(tmp_path, training, path, code):
    _corpus(tmp_path)
    cfg = _cfg(tmp_path, 30, **training)
    line = next(i for i, text in enumerate(cfg.read_text().splitlines(), 1) if path.rsplit(".", 1)[1] + ":" in text
                and (path.endswith("threshold") or "patience: 30" in text))
    for command in ("validate", "plan"):
        r = CliRunner().invoke(app, ["train", command, str(cfg), "--json"])
        assert r.exit_code == 1, r.output
        (f,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == code]
        assert f["path"] == path and f["line"] == line and f["file"] == str(cfg)


def test_a_threshold_that_is_not_above_one_is_refused(tmp_path):
    _corpus(tmp_path)
    cfg = _cfg(tmp_path, 30, rollback={"threshold": 0.9})
    r = CliRunner().invoke(app, ["train", "validate", str(cfg), "--json"])
    assert r.exit_code == 1
    assert any(f["path"] == "training.rollback.threshold" for f in json.loads(r.stdout)["findings"])
