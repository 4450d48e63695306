"""`apr profile` through the CLI: the JSON document, the text tables, and bad input (exit 1, no
traceback, nothing written)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()
FAST = ("--steps", "1", "--repeats", "1", "--new-tokens", "2", "--seq-len", "16", "--batch-size", "1")


def invoke(*args):
    return runner.invoke(app, ["profile", *map(str, args)])


def test_json_has_latency_step_and_comparison(untrained_lm):
    # 14 + 2 new tokens: the decode's RoPE table is the training step's length (16), made in inference mode
    r = invoke(untrained_lm.run_dir, *FAST, "--length", "14", "--prompt", "def f(x):", "--compare", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format_version"] == "1" and doc["kind"] == "run" and doc["checkpoint_step"] == untrained_lm.steps
    (lat,) = doc["latency"]
    assert lat["prompt_tokens"] == 14 and lat["new_tokens"] == 2 and lat["kv_cache_bytes"] > 0
    step = doc["step"]
    assert [row["name"] for row in step["layers"]] == ["embed_tokens", "layers.0", "layers.1", "head+loss"]
    assert step["tokens"] == 16 and step["tokens_per_s"] > 0 and "overhead_fraction" in step
    assert {c["figure"] for c in doc["compare"]} >= {"flops_per_token", "block_saved_bytes"}


def test_text_output_of_a_hugging_face_folder(untrained_lm):
    r = invoke(untrained_lm.hf_dir, *FAST, "--length", "4", "--length", "12")
    assert r.exit_code == 0, r.output
    assert "inference latency" in r.stdout and "training step: batch 1 x seq 16" in r.stdout
    assert "layers.1" in r.stdout and "overhead" in r.stdout
    assert "plan vs measured" not in r.stdout  # only with --compare


@pytest.mark.parametrize("args, message", [
    (("--length", "500"), "does not fit the model's context of 96"),
    (("--no-latency", "--seq-len", "97"), "longer than the model's context of 96"),
    (("--no-step", "--no-latency"), "nothing to measure"),
    (("--steps", "0"), "--steps must be at least 1"),
    (("--steps", str(10**9)), "--steps must be at most 1,000"),
    (("--repeats", str(10**9)), "--repeats must be at most 1,000"),
    # a batch the plan's memory estimate puts past this machine's memory: refused before allocating
    (("--no-latency", "--batch-size", str(10**8)), "by the plan's memory estimate, more than"),
])
def test_bad_options_exit_1_with_the_reason(untrained_lm, args, message):
    r = invoke(untrained_lm.checkpoint, *args)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert message in r.stderr


def test_not_a_checkpoint_exits_1_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bogus = tmp_path / "model.safetensors"
    bogus.write_bytes(b"not a safetensors file")
    r = invoke(bogus, "--no-latency")
    assert r.exit_code == 1 and "Traceback" not in r.output and r.stderr.startswith("error")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def _config(tmp_path, engine: str):
    import yaml

    path = tmp_path / f"{engine}.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"architecture": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 53,
                                   "max_position_embeddings": 32}},
        "data": {"train": "not-built-yet/", "batch_size": 2, "seq_len": 12},
        "training": {"engine": engine, "mixed_precision": "fp32", "device": "cpu", "kernels": "torch",
                     "execution": {"activations": "recompute", "gradients": "kept"}}}))
    return path


@pytest.mark.parametrize("engine, words", [("interleaved", "the interleaved block walk"),
                                           ("standard", "autograd")])
def test_a_config_profiles_the_engine_its_run_would_build(tmp_path, monkeypatch, engine, words):
    monkeypatch.chdir(tmp_path)
    path = _config(tmp_path, engine)
    r = invoke(path, "--steps", "1", "--repeats", "1", "--new-tokens", "2", "--length", "8")
    assert r.exit_code == 0, r.output
    assert f"engine: {engine} ({words})" in r.stdout and "execution activations recompute" in r.stdout
    assert "training step: 1 micro-batch of 2 x seq 12" in r.stdout and "inference latency" in r.stdout
    doc = json.loads(invoke(path, "--steps", "1", "--no-latency", "--json").stdout)
    assert doc["kind"] == "config" and doc["engine"]["gradient_source"] == engine
    assert doc["step"]["tokens"] == 24 and doc["step"]["tokens_per_s"] > 0 and doc["latency"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing written, no data read


@pytest.mark.parametrize("args, message", [
    (("--prompt", "hi"), "--prompt with a config needs a tokenizer"),
    (("--no-latency", "--seq-len", "33"), "longer than the model's context of 32"),
    (("--no-latency", "--batch-size", str(10**8)), "by the plan's memory estimate, more than"),
    (("--steps", str(10**9)), "--steps must be at most 1,000"),
])
def test_bad_options_with_a_config_exit_1_with_the_reason(tmp_path, args, message):
    r = invoke(_config(tmp_path, "interleaved"), *args)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert message in r.stderr
