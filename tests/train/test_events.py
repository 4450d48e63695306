"""What the run loop says and records besides the step's metrics (apr/train/events.py): the recorder
rank 0 opens (the resolved config and the plan beside the records; other ranks record nothing), the
banner, step 0's validation, a mixture's figures and stage starts, distillation's phases and
autotune, stacking's growth, alerts, in-training tasks and samples, as they land in
training_state.json, the stores and the terminal."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from apr.checkpoint.rng import capture_rng, restore_rng
from apr.config.schema import AprConfig
from apr.data.shards import write_dataset
from apr.model.spec import param_count
from apr.plan.build import build_plan, resolve_config
from apr.plan.examples import to_yaml
from apr.steps.distill import phase_at
from apr.track.protocol import NullRecorder
from apr.track.recorder import RunRecorder
from apr.train import events
from apr.train.outdir import LOCK_FILE, RESOLVED_CONFIG_HEADER
from apr.train.run import ApplyOptions, prepare_run
from tests.train.run_helpers import BASE, SEQ, VOCAB, make_dataset, merge, write_config
from tests.train.tiny import make_config


class Rec:
    """The events a recorder is given, for the records made from fakes."""

    def __init__(self):
        self.events: list[tuple[str, int, str, dict | None]] = []
        self.task_evals: list[tuple[int, dict]] = []

    def log_event(self, kind, step, message, detail=None):
        self.events.append((kind, step, message, detail))

    def log_task_evals(self, step, result):
        self.task_evals.append((step, result))


@pytest.fixture(autouse=True)
def _rngs_put_back():
    """A prepared run seeds the process's RNGs: put back as they were."""
    saved = capture_rng()
    yield
    restore_rng(saved)


def _prepare(plan, lines: list[str]):
    opts = ApplyOptions(echo=lines.append, handle_signals=False)
    return prepare_run(resolve_config(plan.config), config_hash=plan.config_hash, config_path=plan.config_path,
                       options=opts,
                       plan_doc=plan.to_dict())


@pytest.fixture
def run_of():
    """A prepared (never executed) run of a plan; its lock and recorder closed at the end."""
    made: list = []

    def make(plan):
        lines: list[str] = []
        run = _prepare(plan, lines)
        run.lines = lines
        made.append(run)
        return run

    yield make
    for run in made:
        recorder = getattr(run, "recorder", None)
        if recorder is not None:
            recorder.finish("finished")
        run.lock.release()


def _opened(run):
    run.recorder = events.open_recorder(run)
    run.run_id = run.recorder.run_id
    run.recorder.start()
    return run.recorder


def _state(run) -> dict:
    run.recorder.finish("finished")
    return json.loads((run.run_dir / "training_state.json").read_text())


def _db(run, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(run.run_dir / ".apr" / "experiments.db")) as con:
        return con.execute(sql).fetchall()


@pytest.fixture
def plan(tmp_path):
    make_dataset(tmp_path)
    return build_plan(write_config(tmp_path))


def test_rank_0_writes_the_resolved_config_and_plan_and_registers_the_run(plan, run_of):
    run = run_of(plan)
    recorder = _opened(run)
    assert isinstance(recorder, RunRecorder)
    header, _, body = (run.run_dir / "config.yaml").read_text().partition("\n")
    assert header == f"{RESOLVED_CONFIG_HEADER} (from {plan.config_path}); hash {run.config_hash}"
    assert AprConfig.model_validate(yaml.safe_load(body)) == run.config
    assert json.loads((run.run_dir / "plan.json").read_text()) == json.loads(json.dumps(plan.to_dict()))
    state = _state(run)
    assert state["run_id"] == recorder.run_id and state["status"] == "finished"
    assert state["total_steps"] == 12 and state["tokens_total"] == 12 * 64  # 12 steps x 4 rows x 16 tokens
    assert state["model_params"] == param_count(run.config.model.architecture)
    assert state["config_path"] == str(plan.config_path)
    with contextlib.closing(sqlite3.connect(Path(os.environ["APR_HOME"]) / "experiments.db")) as con:
        assert con.execute("select id from runs").fetchall() == [(recorder.run_id,)]


def test_other_ranks_record_nothing(plan, run_of):
    run = run_of(plan)
    run.is_main = False
    run.run_id = "20260101-000000-abcdef"
    recorder = events.open_recorder(run)
    assert isinstance(recorder, NullRecorder) and recorder.run_id == run.run_id
    assert sorted(p.name for p in run.run_dir.iterdir()) == [str(LOCK_FILE)]  # the lock prepare_run took, alone


def test_the_banner_says_what_the_run_does(plan, run_of):
    run = run_of(plan)
    run.run_id = "20260101-000000-abcdef"
    lines = events.banner(run).splitlines()
    assert lines[0] == f"apply: starting; run 20260101-000000-abcdef -> {run.run_dir}"
    assert lines[1].startswith(f"  model {param_count(run.config.model.architecture) / 1e6:.2f}M params; ")
    assert lines[1].endswith("fp32 on cpu")
    assert lines[2] == "  12 steps x 64 tokens = 0.5 epochs of 24 steps (96 sequences)"  # 96 rows / 4 a step
    assert len(lines) == 3  # no mixture line
    run.resumed_from, run.start_step = run.run_dir / "checkpoint-step-4.json", 4
    assert events.banner(run).startswith("apply: resuming at step 5; run ")


def _source(folder: Path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCAB, size=rows + 8)
    data = ((starts[:, None] + np.arange(SEQ + 1)[None, :]) % VOCAB).astype(np.uint32)
    manifest = {"seq_len": SEQ, "row_len": SEQ + 1, "tokenizer": {"sha256": "t" * 64}, "documents": rows,
                "tokens_total": (rows + 8) * (SEQ + 1)}
    write_dataset(folder, {"train": data[:rows], "val": data[rows:]}, manifest, 16)


STAGES = [{"name": "main", "start": 0, "weights": {"web": 0.5, "code": 0.3, "books": 0.2}},
          {"name": "decay", "start": 0.5, "weights": {"web": 0.0, "code": 3.0, "books": 1.0}}]


@pytest.fixture
def mixture(tmp_path):
    """A 3-source mixture (books without a val folder) in 2 stages, early stopping on."""
    for i, (name, rows) in enumerate((("web", 40), ("code", 24), ("books", 16))):
        _source(tmp_path / name, rows, seed=10 + i)
    sources = [{"name": n, "path": str(tmp_path / n / "train"), "weight": w,
                **({"val": str(tmp_path / n / "val")} if n != "books" else {})}
               for n, w in (("web", 0.5), ("code", 0.3), ("books", 0.2))]
    doc = merge(BASE, {"data": {"train": sources, "val": None, "stages": STAGES},
                       "training": {"output_dir": str(tmp_path / "run"), "max_steps": 20, "epochs": 1,
                                    "early_stopping": {"patience": 2}}})
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(doc))
    return build_plan(path)


def test_the_banner_names_a_mixtures_sources_and_stage(mixture, run_of):
    run = run_of(mixture)
    assert events.banner(run).splitlines()[-1] == \
        "  mixture of 3 sources (web, code, books) in 2 stage(s), stage 'main' now"


def test_step_0_validation_reaches_the_state_the_stores_and_early_stopping(mixture, run_of):
    run = run_of(mixture)
    _opened(run)
    events.validated_initially(run, run.recorder)
    first, by_source = run.validation.first, dict(run.validation.by_source)
    assert set(by_source) == {"web", "code"}  # books has no val folder
    assert first == pytest.approx((by_source["web"] + by_source["code"]) / 2)
    assert (run.early_stopping.best, run.early_stopping.best_step) == (first, 0)
    state = _state(run)
    assert state["val_loss_history"] == [[0, pytest.approx(first)]]
    assert state["mixture"]["step"] == 0 and state["mixture"]["stage_name"] == "main"
    assert {n: s.get("val_loss") for n, s in state["mixture"]["sources"].items()} == \
        {"web": pytest.approx(by_source["web"]), "code": pytest.approx(by_source["code"]), "books": None}
    assert _db(run, "select key, step from metrics where key like 'val_loss%' order by key") == \
        [("val_loss", 0), ("val_loss/code", 0), ("val_loss/web", 0)]


def test_a_mixtures_figures_are_the_rows_it_drew(mixture, run_of):
    run = run_of(mixture)
    _opened(run)
    for _ in range(5):
        run.loader.next_batch()
    events.record_mixture(run, 5, run.recorder)
    sources = _state(run)["mixture"]["sources"]
    assert sum(s["rows"] for s in sources.values()) == 5 * 4  # 5 micro-batches of 4 rows
    held = {"web": 40, "code": 24, "books": 16}
    for name, s in sources.items():
        assert s["tokens"] == s["rows"] * SEQ and s["epochs"] == pytest.approx(s["rows"] / held[name])
    tokens = dict(_db(run, "select key, value from metrics where key like 'tokens/%'"))
    assert tokens == {f"tokens/{n}": s["tokens"] for n, s in sources.items()}


def test_a_single_source_run_records_no_mixture(plan, run_of):
    run = run_of(plan)
    _opened(run)
    run.loader.next_batch()
    events.record_mixture(run, 1, run.recorder)
    assert _state(run).get("mixture") is None


def test_a_stage_start_is_an_event_in_the_state_and_stores_and_a_line(mixture, run_of):
    run = run_of(mixture)
    _opened(run)
    while run.loader.stage == 0:  # stage 2 starts at half the run: step 11's first micro-batch
        run.loader.next_batch()
    assert run.loader.absolute == 11
    events.stage_started(run, 11, run.recorder)
    message = run.lines[-1].removeprefix("step 11/20  ")
    head, _, mix = message.partition(": ")
    assert head == "data stage 'decay' starts at step 11"
    assert sorted(mix.removesuffix(" of tokens").split(", ")) == ["books 25%", "code 75%"]  # web's 0 left out
    [event] = [e for e in _state(run)["events"] if e["kind"] == "stage"]
    assert (event["step"], event["message"]) == (11, message)
    assert event["detail"] == {"stage": 1, "name": "decay",
                               "token_shares": {"web": 0.0, "code": 0.75, "books": 0.25}}
    assert _db(run, "select kind, step, message from events") == [("stage", 11, message)]


def _distill_run(lines: list[str]):
    config = make_config(training={"mode": "distill", "distill": {"teacher": "/unused", "phase1_steps": 2}})
    autotune = SimpleNamespace(events=[])
    loss = SimpleNamespace(last_phase=None, started=False, spans=[(0, 2), (2, 4), (4, 6)], autotune=autotune,
                           events=[])
    return SimpleNamespace(config=config, engine=SimpleNamespace(loss=loss), echo=lines.append,
                           step_label=lambda step: f"step {step}/8")


def test_distillation_records_each_phase_start_and_the_autotunes_events():
    """3 student blocks x phase1_steps 2: block 0 from step 1, 1 from 3, 2 from 5, phase 2 from 7."""
    lines: list[str] = []
    run, rec = _distill_run(lines), Rec()
    for step in range(1, 9):
        run.engine.loss.last_phase = phase_at(run.config, step)
        run.engine.loss.started = step == 1 or phase_at(run.config, step - 1) != phase_at(run.config, step)
        if step == 6:
            run.engine.loss.events.append(("distill_block", "phase 1: student block 2 finished", {"block": 2}))
        if step == 4:
            run.engine.loss.autotune.events.append(("autotune", "kd weight 0.5 -> 0.25", {"kd_weight": 0.25}))
        events.distill_records(run, step, rec)
    assert [(kind, step, detail) for kind, step, _, detail in rec.events] == [
        ("distill", 1, {"phase": 1, "block": 0}), ("distill", 3, {"phase": 1, "block": 1}),
        ("autotune", 4, {"kd_weight": 0.25}), ("distill", 5, {"phase": 1, "block": 2}),
        ("distill_block", 6, {"block": 2}), ("distill", 7, {"phase": 2, "block": None})]
    assert rec.events[1][2] == "distillation phase 1: student block 1 learns teacher blocks 2-3 from step 3"
    assert rec.events[-1][2] == "distillation phase 2: the whole student on KD + LM loss from step 7"
    assert run.engine.loss.autotune.events == [] and run.engine.loss.events == []  # recorded once
    assert "step 4/8  autotune: kd weight 0.5 -> 0.25" in lines


@pytest.mark.parametrize(("earlier", "frozen", "suffix"), [
    ("freeze", {"block.0", "block.1"}, "(copy_top, earlier blocks frozen)"), ("train", set(), "(copy_top)")])
def test_stacking_growth_is_an_event_and_a_line(earlier, frozen, suffix):
    stacking = {"stages": [{"blocks": 2, "steps": 6}, {"blocks": 4}], "init": "copy_top", "earlier": earlier}
    config = make_config(model={"architecture": {"num_hidden_layers": 4}, "stacking": stacking})
    lines: list[str] = []
    engine = SimpleNamespace(model=SimpleNamespace(model=SimpleNamespace(layers=[None] * 4)), frozen=frozen)
    run = SimpleNamespace(config=config, engine=engine, stack_stage=1, echo=lines.append,
                          step_label=lambda step: f"step {step}/12")
    rec = Rec()
    events.grown(run, 7, 2, rec)
    message = f"stacking stage 1 starts at step 7: 2 -> 4 blocks {suffix}"
    assert rec.events == [("stack", 7, message, {"stage": 1, "blocks": 4, "from_blocks": 2, "init": "copy_top",
                                                 "building_mode": "append"})]
    assert lines == [f"step 7/12  {message}"]


def test_alerts_are_printed_and_recorded_and_the_first_stop_alert_stops(tmp_path, run_of):
    make_dataset(tmp_path)
    alerts = [{"condition": "loss > 5", "action": "warn", "message": "loss is high"},
              {"condition": "step >= 3", "action": "stop", "message": "enough"}]
    run = run_of(build_plan(write_config(tmp_path, monitoring={"alerts": alerts})))
    _opened(run)
    assert events.check_alerts(run, {"step": 2, "loss": 6.0}, 2, run.recorder) is None
    assert run.lines[-1].startswith("alert (warning) at step 2: loss is high")
    stop = events.check_alerts(run, {"step": 3, "loss": 1.0}, 3, run.recorder)
    assert (stop.status, stop.exit_code) == ("stopped", 1) and stop.reason.startswith("alert: enough")
    assert run.lines[-1] == f"alert (error) at step 3: {stop.reason.removeprefix('alert: ')}"
    _state(run)
    assert [(step, action, message.split(" (")[0]) for step, action, message in
            _db(run, "select step, action, message from alerts order by step")] == \
        [(2, "warn", "loss is high"), (3, "stop", "enough")]


class Evaluator:
    def __init__(self, result: dict):
        self.result, self.calls = result, []

    def run(self, model, step):
        self.calls.append(step)
        return self.result


def _evaluating_run(result: dict, *, rank: int = 0, sharded: bool = False):
    lines: list[str] = []
    checked: list = []
    engine = SimpleNamespace(sharded=sharded, model="the model", whole_weights=contextlib.nullcontext)
    run = SimpleNamespace(dp=SimpleNamespace(rank=rank), engine=engine, is_main=rank == 0,
                          evaluator=Evaluator(result), echo=lines.append, step_label=lambda step: f"step {step}/12",
                          check_alerts=lambda metrics, step, rec: checked.append((metrics, step)) or "alerts' stop")
    return run, lines, checked


TASKS = {"tasks": {"arc": {"acc": 0.5, "acc_norm": 0.25}}, "seconds": 0.4, "metrics": {"eval.arc.acc": 0.5},
         "samples": [{"prompt": "def f(", "text": "x):"}]}


def test_task_scores_and_samples_are_recorded_printed_and_checked_by_the_alerts():
    run, lines, checked = _evaluating_run(TASKS)
    rec = Rec()
    assert events.tasks_and_samples(run, 3, rec) == "alerts' stop"
    assert rec.task_evals == [(3, {**TASKS, "stage": None})]  # one stage: no stage label
    assert lines == ["step 3/12  eval arc acc 0.500 acc_norm 0.250 (0.4 s)", "  sample: 'def f(' -> 'x):'"]
    assert checked == [({"step": 3}, 3)]  # eval.<task>.acc conditions see the new scores

    samples = {"tasks": {}, "seconds": 0.4, "metrics": {}, "samples": []}
    run, lines, checked = _evaluating_run(samples)
    assert events.tasks_and_samples(run, 3, Rec()) is None
    assert lines == ["step 3/12  samples (0.4 s)"] and checked == []  # no scores: nothing for the alerts


@pytest.mark.parametrize(("sharded", "evaluates"), [(False, False), (True, True)])
def test_other_ranks_record_no_evaluation(sharded, evaluates):
    """Data parallel: rank 0 alone holds the whole model and evaluates; sharded, every rank gathers
    the weights and evaluates, and only rank 0 records."""
    run, lines, checked = _evaluating_run(TASKS, rank=1, sharded=sharded)
    rec = Rec()
    assert events.tasks_and_samples(run, 3, rec) is None
    assert run.evaluator.calls == ([3] if evaluates else [])
    assert rec.task_evals == [] and lines == [] and checked == []


def test_epochs_read_counts_the_epoch_in_progress(plan, run_of):
    run = run_of(plan)
    assert run.loader.micro_batches_per_epoch == 24
    for _ in range(30):
        run.loader.next_batch()
    assert events.epochs_read(run.loader) == pytest.approx(1.25)  # 30 micro-batches at 24 an epoch
