"""`apr runs blame` (apr/track/blame.py and the CLI): the rows of a logged step of a real tiny run,
ranked by loss, located in the data and decoded with the run's tokenizer."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.build import resolve_config
from apr.track.blame import blame, steps_text
from apr.train.run import ApplyOptions, prepare_run
from tests.evaluate.test_during_training import word_tokenizer
from tests.train.run_helpers import VOCAB, config_doc, make_dataset

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run logging every 2 steps, with a word tokenizer (token i reads as the word "i")."""
    root = tmp_path_factory.mktemp("blame")
    make_dataset(root)
    doc = config_doc(root, data={"tokenizer": str(word_tokenizer(root / "tok.json"))},
                     training={"max_steps": 6, "save_interval": 6, "eval_interval": 0, "log_interval": 2})
    cfg = AprConfig.model_validate(doc)
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(echo=lambda line: None, handle_signals=False, apr_home=root / "home"))
    assert run.execute().status == "finished"
    return root, run.run_id


@pytest.fixture
def here(trained, monkeypatch):
    root, run_id = trained
    monkeypatch.chdir(root)
    monkeypatch.setenv("APR_HOME", str(root / "home"))
    return root, run_id


def test_the_rows_of_a_step_ranked_by_loss_with_their_place_in_the_data_and_their_text(here):
    root, run_id = here
    result = blame(run_id[:-1], 4, top=3)
    assert result["run_id"] == run_id and result["step"] == 4 and result["row_count"] == 4
    rows = result["rows"]
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] >= rows[1]["loss"] >= rows[2]["loss"]
    assert all(r["source"] == str(root / "data" / "train") for r in rows)  # one source: data.train
    for r in rows:  # the text is the row's tokens, read from its shard, decoded
        ids = pq.read_table(root / "data" / "train" / r["shard"]).column("input_ids")[r["row"]].as_py()
        assert r["text"].split() == [str(i) if i < VOCAB - 1 else "[UNK]" for i in ids]  # its last id is [UNK]
    assert result["notes"] == []
    every = blame(run_id, 4, top=None, decode=False)
    assert len(every["rows"]) == 4 and all(r["text"] is None for r in every["rows"])
    assert every["mean_loss"] == pytest.approx(sum(r["loss"] for r in every["rows"]) / 4)


def test_a_step_without_a_record_names_the_steps_that_have_one(here):
    _, run_id = here
    with pytest.raises(AprError) as e:
        blame(run_id, 3)
    assert "no row losses at step 3; steps with a record: 2, 4, 6" in e.value.message
    assert e.value.findings[0].code == "runs.no_blame"
    assert steps_text(list(range(10, 5001, 10))) == "10, 20, 30, ..., 4980, 4990, 5000 (500 steps)"


def test_cli_table_json_and_errors(here):
    _, run_id = here
    result = runner.invoke(app, ["runs", "blame", run_id, "--step", "2", "--top", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"run {run_id} step 2: 2 of 4 rows by loss (mean ")
    assert lines[1].split() == ["RANK", "LOSS", "SOURCE", "SHARD", "ROW", "MICRO-BATCH", "TEXT"]
    assert [ln.split()[0] for ln in lines[2:]] == ["1", "2"]
    assert "shard-0000" in lines[2] and "micro" not in lines[2]
    doc = json.loads(runner.invoke(app, ["runs", "blame", run_id, "--step", "6", "--all", "--json"]).stdout)
    assert len(doc["rows"]) == 4 and set(doc["rows"][0]) == {"rank", "loss", "source", "shard", "row", "data_index",
                                                             "micro_batch", "text"}
    assert {r["micro_batch"] for r in doc["rows"]} == {5}  # step 6's one micro-batch
    missing = runner.invoke(app, ["runs", "blame", run_id, "--step", "5"])
    assert missing.exit_code == 1 and "steps with a record: 2, 4, 6" in missing.output
    assert "Traceback" not in missing.output
    assert runner.invoke(app, ["runs", "blame", "20991231-000000-ffffff", "--step", "2"]).exit_code == 1


def test_without_the_tokenizer_the_rows_are_shown_and_a_note_says_why(here):
    root, run_id = here
    (root / "tok.json").rename(root / "tok.moved")
    try:
        result = blame(run_id, 2)
    finally:
        (root / "tok.moved").rename(root / "tok.json")
    assert all(r["text"] is None for r in result["rows"]) and len(result["rows"]) == 4
    assert result["notes"] and "text not shown" in result["notes"][0] and "tok.json" in result["notes"][0]
