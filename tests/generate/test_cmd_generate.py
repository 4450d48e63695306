"""`apr generate` through the CLI: text, --json, prompt files and stdin, and bad input (exit 1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.model.spec import kv_cache_bytes_per_token

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, ["generate", *map(str, args)], input=input)


def test_json_output_holds_text_ids_and_logprobs(tiny_lm):
    r = invoke(tiny_lm.run_dir, "--prompt", tiny_lm.lines[0], "-n", "6", "--json", "--logprobs", "--ignore-eos")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kind"] == "run" and doc["step"] == tiny_lm.steps and doc["settings"]["greedy"] is True
    (g,) = doc["generations"]
    assert g["prompt"] == tiny_lm.lines[0] and g["generated_tokens"] == 6 == len(g["token_ids"]) == len(g["logprobs"])
    assert g["finish_reason"] == "length" and all(lp <= 0 for lp in g["logprobs"])
    assert doc["kv_cache_bytes_per_token"] == kv_cache_bytes_per_token(tiny_lm.config.model.architecture, 4)


def test_text_output_streams_the_prompt_and_its_continuation(tiny_lm):
    r = invoke(tiny_lm.checkpoint, "-p", tiny_lm.lines[3], "-n", "8", "--ignore-eos")
    assert r.exit_code == 0, r.output
    jr = json.loads(invoke(tiny_lm.checkpoint, "-p", tiny_lm.lines[3], "-n", "8", "--ignore-eos", "--json").stdout)
    assert r.stdout == tiny_lm.lines[3] + jr["generations"][0]["text"] + "\n"
    assert "tok/s" in r.stderr


def test_prompt_file_and_stdin_give_one_batch(tiny_lm, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text(f"{tiny_lm.lines[1]}\n\n{tiny_lm.lines[5]}\n")
    from_file = json.loads(invoke(tiny_lm.hf_dir, "--prompt-file", f, "-n", "4", "--json").stdout)
    from_stdin = json.loads(invoke(tiny_lm.hf_dir, "--prompt-file", "-", "-n", "4", "--json",
                                   input=f.read_text()).stdout)
    assert [g["prompt"] for g in from_file["generations"]] == [tiny_lm.lines[1], tiny_lm.lines[5]]
    assert from_file["generations"] == from_stdin["generations"]
    whole = json.loads(invoke(tiny_lm.hf_dir, "--prompt", "-", "-n", "4", "--json", input="a\nb").stdout)
    assert whole["generations"][0]["prompt"] == "a\nb"
    r = invoke(tiny_lm.hf_dir, "--prompt-file", f, "-n", "4")
    assert r.exit_code == 0 and r.stdout.count("--- prompt") == 2


def test_seeded_sampling_from_the_cli_is_reproducible(tiny_lm):
    args = (tiny_lm.checkpoint, "-p", "def", "-n", "12", "-t", "1.2", "--top-p", "0.95", "--seed", "4", "--json")
    a, b = json.loads(invoke(*args).stdout), json.loads(invoke(*args).stdout)
    assert a["seed"] == 4 and a["generations"] == b["generations"]


def error(r) -> str:
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    return r.stderr


def test_bad_input_is_a_clear_error_with_exit_1(tiny_lm, tmp_path):
    assert "empty" in error(invoke(tiny_lm.checkpoint, "--prompt", ""))
    err = error(invoke(tiny_lm.checkpoint, "--prompt", " ".join(tiny_lm.lines)))
    assert "context is 96" in err and "generate.prompt_too_long" in err
    err = error(invoke(tmp_path / "no-such-run", "--prompt", "x"))
    assert "no-such-run" in err and "does not exist" in err
    assert "no prompt" in error(invoke(tiny_lm.checkpoint))
    assert "prompt file" in error(invoke(tiny_lm.checkpoint, "--prompt-file", tmp_path / "missing.txt"))
    assert "--max-new-tokens" in error(invoke(tiny_lm.checkpoint, "-p", "x", "-n", "0"))
    assert "--top-p" in error(invoke(tiny_lm.checkpoint, "-p", "x", "-t", "1", "--top-p", "0"))
    assert "empty" in error(invoke(tiny_lm.checkpoint, "-p", "x", "--stop", ""))


def test_a_checkpoint_without_a_tokenizer_is_refused(tiny_lm, tmp_path):
    import shutil

    from apr.checkpoint.manager import CheckpointManager, read_checkpoint
    from tests.generate.tiny_lm import config_doc

    state = read_checkpoint(tiny_lm.checkpoint)
    doc = config_doc(tiny_lm.tokenizer)
    doc["data"]["tokenizer"] = None
    no_tok = CheckpointManager(tmp_path / "a", doc).save(state)
    err = error(invoke(no_tok, "-p", "x"))
    assert "names no tokenizer" in err and "--tokenizer" in err and "data.tokenizer" in err
    r = invoke(no_tok, "-p", "x", "--tokenizer", tiny_lm.tokenizer, "-n", "2")
    assert r.exit_code == 0, r.output

    doc["data"]["tokenizer"] = str(tmp_path / "gone.json")
    missing = CheckpointManager(tmp_path / "b", doc).save(state)
    assert "gone.json" in error(invoke(missing, "-p", "x"))

    hf = tmp_path / "hf"
    shutil.copytree(tiny_lm.hf_dir, hf)
    (hf / "tokenizer.json").unlink()
    assert "no tokenizer.json" in error(invoke(hf, "-p", "x"))


def other_tokenizer(tiny_lm, folder):
    """The model's tokenizer with two tokens swapped: the same size, another file."""
    spec = json.loads(tiny_lm.tokenizer.read_text())
    vocab = spec["model"]["vocab"]
    (a, ia), (b, ib) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = ib, ia
    path = folder / "other-tokenizer.json"
    path.write_text(json.dumps(spec))
    return path


def test_another_tokenizer_than_the_runs_own_is_warned_about_naming_both_digests(tiny_lm, tmp_path):
    import hashlib

    other = other_tokenizer(tiny_lm, tmp_path)
    own_sha = hashlib.sha256(tiny_lm.tokenizer.read_bytes()).hexdigest()
    other_sha = hashlib.sha256(other.read_bytes()).hexdigest()
    for source in (tiny_lm.run_dir, tiny_lm.hf_dir):
        r = invoke(source, "-p", "x", "-n", "2", "--tokenizer", other)
        assert r.exit_code == 0, r.output
        assert "is not the tokenizer the model was trained with" in r.stderr
        assert own_sha in r.stderr and other_sha in r.stderr
    copy = tmp_path / "copy.json"  # the same tokenizer under another name: no warning
    copy.write_bytes(tiny_lm.tokenizer.read_bytes())
    r = invoke(tiny_lm.run_dir, "-p", "x", "-n", "2", "--tokenizer", copy)
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output


def test_a_prompt_longer_than_the_context_names_its_line_and_is_not_echoed(tiny_lm, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("SECRET " * 400 + "\n")
    r = invoke(tiny_lm.run_dir, "--prompt-file", f, "-n", "2")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert f"--prompt-file {f} line 1 is" in r.stderr and "the model's context is 96" in r.stderr
    assert "SECRET" not in r.output


@pytest.mark.parametrize("temperature", ["1e-300", "1e-40", "1e300"])
def test_extreme_temperatures_sample_without_a_traceback(tiny_lm, temperature):
    r = invoke(tiny_lm.run_dir, "-p", tiny_lm.lines[0], "-n", "3", "-t", temperature, "--seed", "1",
               "--repetition-penalty", "1e-30")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
