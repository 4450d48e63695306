"""`apr train text FILE`: one command from a text file to a trained run (CPU, a few steps)."""

from __future__ import annotations

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()
TEXT = "".join(f"{i} green eggs and ham, sam i am; i do not like them here or there.\n" for i in range(80))


def test_one_command_prepares_and_trains_and_bad_input_is_one_error_line(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    r = runner.invoke(app, ["train", "text", str(src), "--out", str(out), "--seq-len", "32", "--max-steps", "3",
                            "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "char tokenizer of" in r.output and "finished, step 3" in r.output
    assert (out / "run" / "checkpoint-step-3.json").is_file() and (out / "config.yaml").is_file()
    r = runner.invoke(app, ["train", "text", str(src), "--out", str(out), "--seq-len", "32"])
    assert r.exit_code == 1 and "not empty" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["train", "text", str(src), "--out", str(tmp_path / "o2"), "--tokenizer", "wordpiece"])
    assert r.exit_code == 1 and "expected char or bpe, got wordpiece" in r.output
    r = runner.invoke(app, ["train", "text", str(src), "--out", str(tmp_path / "o3"), "--tokenizer", "bpe",
                            "--vocab-size", "300", "--seq-len", "16", "--prepare-only"])
    assert r.exit_code == 0 and "bpe tokenizer of" in r.output and "train with: apr train apply" in r.output
    assert not (tmp_path / "o3" / "run").exists()
