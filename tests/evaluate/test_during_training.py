"""Evaluation during training: a run with evaluation.tasks and samples records the scores in
training_state.json and the stores, and an alert on a task's accuracy fires."""

from __future__ import annotations

import json

import pytest

from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.build import resolve_config
from tests.train.run_helpers import VOCAB, config_doc, make_dataset


def word_tokenizer(path):
    """Token i is the word str(i): the pattern data of run_helpers reads as numbers."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def counting_task(path):
    lines = []
    for start in range(10):
        ctx = " ".join(str(start + i) for i in range(6))
        lines.append(json.dumps({"context": ctx, "choices": [f" {start + 6}", f" {start + 30}", f" {start + 17}"],
                                 "gold": 0}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run(root, **sections):
    from apr.config import config_hash
    from apr.train.run import ApplyOptions, prepare_run

    cfg = AprConfig.model_validate(config_doc(root, **sections))
    lines: list[str] = []
    r = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                    options=ApplyOptions(echo=lines.append))
    return r.execute(), lines


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    word_tokenizer(tmp_path / "tok.json")
    counting_task(tmp_path / "count.jsonl")
    return tmp_path


def test_a_run_with_an_eval_interval_records_task_scores_and_samples(root, capsys):
    result, lines = run(
        root, data={"tokenizer": str(root / "tok.json")},
        evaluation={"tasks": [str(root / "count.jsonl")], "interval": 4,
                    "samples": {"prompts": ["1 2 3"], "max_new_tokens": 3}},
        monitoring={"alerts": [{"condition": "eval.count.acc <= 1.0", "action": "warn", "message": "acc seen"}]})
    assert result.status == "finished" and result.final_step == 12
    state = json.loads((root / "run" / "training_state.json").read_text())
    score = state["evals"]["count"]
    assert score["step"] == 12 and score["examples"] == 10 and 0 <= score["acc"] <= 1 and 0 <= score["acc_norm"] <= 1
    assert state["samples"]["step"] == 12 and state["samples"]["items"][0]["prompt"] == "1 2 3"
    assert len(state["samples"]["items"][0]["text"].split()) == 3
    assert [a["message"].split(" (")[0] for a in state["alerts"]] == ["acc seen"]
    assert any("eval count acc" in line for line in lines) and any("sample:" in line for line in lines)

    from apr.track import store

    for db in (root / "run" / ".apr" / "experiments.db",):
        conn = store.connect_readonly(db)
        series = store.metric_series(conn, state["run_id"], "eval.count.acc")
        assert [s for s, _ in series] == [4, 8, 12]
        assert series[-1][1] == pytest.approx(score["acc"])
        assert "eval.count.acc_norm" in store.final_metrics(conn, state["run_id"])

    # what a user reads: `apr runs show RUN` (global registry) in text and --json
    from apr.cli.cmd_runs import run_show

    assert run_show(state["run_id"], global_=True, json_out=True) == 0
    detail = json.loads(capsys.readouterr().out)
    assert detail["final_metrics"]["eval.count.acc"]["value"] == pytest.approx(score["acc"])
    assert detail["final_metrics"]["eval.count.acc"]["step"] == 12
    assert run_show(state["run_id"], global_=True) == 0
    text = capsys.readouterr().out
    assert any(line.split()[:1] == ["eval.count.acc"] for line in text.splitlines())


def test_a_stop_alert_on_a_task_score_stops_the_run(root):
    result, lines = run(
        root, data={"tokenizer": str(root / "tok.json")},
        evaluation={"tasks": [str(root / "count.jsonl")], "interval": 4},
        monitoring={"alerts": [{"condition": "eval.count.acc >= 0.0", "action": "stop"}]})
    assert result.status == "stopped" and result.final_step == 4
    assert any(line.startswith("alert (error) at step 4") for line in lines)


def test_bad_evaluation_config_fails_validation_or_start(root, tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="built-in task"):
        AprConfig.model_validate(config_doc(root, evaluation={"tasks": ["hellaswag"]}))
    with pytest.raises(ValidationError):
        AprConfig.model_validate(config_doc(root, evaluation={"samples": {"prompts": []}}))
    with pytest.raises(AprError, match="need the model's tokenizer"):
        run(root, evaluation={"tasks": ["stdlib-nextline"]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "1", "choices": ["2"], "gold": 0}\n')
    with pytest.raises(AprError, match="bad.jsonl:1"):
        run(root, data={"tokenizer": str(root / "tok.json")}, evaluation={"tasks": [str(bad)]})
    assert not (root / "run" / "checkpoint-step-4.json").exists()  # refused before any step
