"""`apr eval` through the CLI: tables, --json, and bad input (exit 1, file and line named)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["eval", *map(str, args)])


def task_file(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"context": "import", "choices": [" json", " xq"], "gold": 0})


def test_json_report_holds_data_losses_and_task_scores(tiny_lm, tmp_path):
    from apr.data.pretokenize import pretokenize

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(tiny_lm.lines) + "\n")
    pretokenize([text], tiny_lm.tokenizer, seq_len=32, out=tmp_path / "ds", val_fraction=0.25)
    r = invoke(tiny_lm.run_dir, "--data", tmp_path / "ds", "--task", "stdlib-nextline", "--limit", "8",
               "--task", task_file(tmp_path, [GOOD, GOOD]), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kind"] == "run" and doc["step"] == tiny_lm.steps
    assert [d["name"] for d in doc["data"]] == ["train", "val"]
    assert all(d["bits_per_byte"] > 0 and d["perplexity"] > 1 for d in doc["data"])
    assert doc["overall"]["tokens"] == sum(d["tokens"] for d in doc["data"])
    nextline, mine = doc["tasks"]
    assert nextline["name"] == "stdlib-nextline" and nextline["examples"] == 8 and nextline["chance"] == 0.25
    assert mine["name"] == "t" and mine["examples"] == 2 and 0 <= mine["acc"] <= 1


def test_the_text_report_is_a_table(tiny_lm, tmp_path):
    r = invoke(tiny_lm.checkpoint, "--task", task_file(tmp_path, [GOOD]))
    assert r.exit_code == 0, r.output
    assert "TASK" in r.stdout and "ACC_NORM" in r.stdout and f"(step {tiny_lm.steps})" in r.stdout


def error(r) -> str:
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    return r.stderr


def test_bad_input_is_a_clear_error_with_exit_1(tiny_lm, tmp_path):
    bad = task_file(tmp_path, [GOOD, '{"context": "x", "choices": ["a"], "gold": 0}', GOOD])
    err = error(invoke(tiny_lm.checkpoint, "--task", bad))
    assert f"{bad}:2" in err and "choices" in err and "--on-error skip" in err
    r = invoke(tiny_lm.checkpoint, "--task", bad, "--on-error", "skip", "--json")
    assert r.exit_code == 0, r.output
    assert f"{bad}:2" in r.stderr and json.loads(r.stdout)["tasks"][0]["skipped"] == 1
    assert "does not exist" in error(invoke(tmp_path / "no-run", "--task", "stdlib-nextline"))
    assert "nothing to evaluate" in error(invoke(tiny_lm.checkpoint))
    assert "not found" in error(invoke(tiny_lm.checkpoint, "--task", tmp_path / "none.jsonl"))
    assert "no such data folder" in error(invoke(tiny_lm.checkpoint, "--data", tmp_path / "nodata"))
    assert "--on-error" in error(invoke(tiny_lm.checkpoint, "--task", bad, "--on-error", "maybe"))


def test_an_unparsable_line_and_a_checkpoint_without_a_tokenizer_are_refused(tiny_lm, tmp_path):
    from apr.checkpoint.manager import CheckpointManager, read_checkpoint
    from tests.generate.tiny_lm import config_doc

    bad = task_file(tmp_path, [GOOD, '{"context": "x", "choi', GOOD])
    err = error(invoke(tiny_lm.checkpoint, "--task", bad))
    assert f"{bad}:2" in err and "not valid JSON" in err
    doc = config_doc(tiny_lm.tokenizer)
    doc["data"]["tokenizer"] = None
    no_tok = CheckpointManager(tmp_path / "a", doc).save(read_checkpoint(tiny_lm.checkpoint))
    err = error(invoke(no_tok, "--task", "stdlib-nextline"))
    assert "names no tokenizer" in err and "--tokenizer" in err


def test_another_tokenizer_than_the_runs_own_is_warned_about(tiny_lm, tmp_path):
    import hashlib

    spec = json.loads(tiny_lm.tokenizer.read_text())
    vocab = spec["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = ib, ia  # the same size, two tokens swapped
    other = tmp_path / "other.json"
    other.write_text(json.dumps(spec))
    r = invoke(tiny_lm.checkpoint, "--task", task_file(tmp_path, [GOOD]), "--tokenizer", other)
    assert r.exit_code == 0, r.output
    assert "is not the tokenizer the model was trained with" in r.stderr
    assert hashlib.sha256(other.read_bytes()).hexdigest() in r.stderr
    assert hashlib.sha256(tiny_lm.tokenizer.read_bytes()).hexdigest() in r.stderr


def test_a_sharded_hf_folder_scores_what_the_checkpoint_does(tiny_lm, tmp_path):
    """`apr eval` reads the Hugging Face export re-sharded into 2 files and an index, as every command does."""
    from tests.generate.tiny_lm import shard_hf

    folder = shard_hf(tiny_lm.hf_dir, tmp_path / "sharded")
    args = ("--task", "stdlib-nextline", "--limit", "6", "--json")
    sharded, ckpt = invoke(folder, *args), invoke(tiny_lm.checkpoint, *args)
    assert sharded.exit_code == 0 and ckpt.exit_code == 0, sharded.output + ckpt.output
    a, b = json.loads(sharded.stdout), json.loads(ckpt.stdout)
    assert a["kind"] == "hf" and a["tasks"][0]["examples"] == 6
    assert a["tasks"][0]["acc"] == b["tasks"][0]["acc"] and a["tasks"][0]["acc_norm"] == b["tasks"][0]["acc_norm"]
