"""Fifty malformed configs of different kinds: each exits 1 with the key path and a line, no traceback."""

from __future__ import annotations

import json

import pytest
from ruamel.yaml import YAML
from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def base() -> dict:
    return {
        "model": {"architecture": {
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}},
        "data": {"train": "data/train", "val": "data/val", "batch_size": 2, "seq_len": 32,
                 "tokenizer": "tok.json"},
        "optimizer": {"lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1},
        "training": {"epochs": 1, "max_steps": 10, "warmup_steps": 1, "output_dir": "out"},
        "monitoring": {"tracking": {"experiment": "x"}, "alerts": [{"condition": "loss > 10", "action": "stop"}]},
    }


def set_path(doc: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


DELETE = object()

# (id, key path to mutate, new value, key path the error must name)
MUTATIONS = [
    ("hidden-str", "model.architecture.hidden_size", "wide", "model.architecture.hidden_size"),
    ("hidden-neg", "model.architecture.hidden_size", -64, "model.architecture.hidden_size"),
    ("hidden-zero", "model.architecture.hidden_size", 0, "model.architecture.hidden_size"),
    ("hidden-float", "model.architecture.hidden_size", 64.5, "model.architecture.hidden_size"),
    ("hidden-bool", "model.architecture.hidden_size", True, "model.architecture.hidden_size"),
    ("layers-list", "model.architecture.num_hidden_layers", [2], "model.architecture.num_hidden_layers"),
    ("heads-null", "model.architecture.num_attention_heads", None, "model.architecture.num_attention_heads"),
    ("kv-bad-suffix", "model.architecture.num_key_value_heads", "2X", "model.architecture.num_key_value_heads"),
    ("vocab-neg", "model.architecture.vocab_size", "-32K", "model.architecture.vocab_size"),
    ("eps-neg", "model.architecture.rms_norm_eps", -1e-5, "model.architecture.rms_norm_eps"),
    ("eps-str", "model.architecture.rms_norm_eps", "tiny", "model.architecture.rms_norm_eps"),
    ("arch-typo", "model.architecture.hiden_size", 64, "model.architecture.hiden_size"),
    ("arch-missing-vocab", "model.architecture.vocab_size", DELETE, "model.architecture.vocab_size"),
    ("arch-missing", "model.architecture", DELETE, "model.architecture"),
    ("arch-scalar", "model.architecture", 7, "model.architecture"),
    ("model-mode", "model.mode", "rnn", "model.mode"),
    ("model-typo", "model.pth", ".", "model.pth"),
    ("model-missing", "model", DELETE, "model"),
    ("data-missing", "data", DELETE, "data"),
    ("data-list", "data", [1, 2], "data"),
    ("train-missing", "data.train", DELETE, "data.train"),
    ("train-int", "data.train", {"a": 1}, "data.train"),
    ("batch-neg", "data.batch_size", -4, "data.batch_size"),
    ("batch-zero", "data.batch_size", 0, "data.batch_size"),
    ("seq-str", "data.seq_len", "long", "data.seq_len"),
    ("seq-missing", "data.seq_len", DELETE, "data.seq_len"),
    ("shuffle-str", "data.shuffle", "sometimes", "data.shuffle"),
    ("data-typo", "data.batchsize", 4, "data.batchsize"),
    ("opt-name", "optimizer.name", "adagrad", "optimizer.name"),
    ("lr-neg", "optimizer.lr", -1.0, "optimizer.lr"),
    ("lr-str", "optimizer.lr", "fast", "optimizer.lr"),
    ("beta1-one", "optimizer.beta1", 1.0, "optimizer.beta1"),
    ("beta2-big", "optimizer.beta2", 2.0, "optimizer.beta2"),
    ("wd-neg", "optimizer.weight_decay", -0.1, "optimizer.weight_decay"),
    ("opt-typo", "optimizer.learning_rate", 0.1, "optimizer.learning_rate"),
    ("epochs-neg", "training.epochs", -1, "training.epochs"),
    ("max-steps-str", "training.max_steps", "many", "training.max_steps"),
    ("warmup-neg", "training.warmup_steps", -5, "training.warmup_steps"),
    ("sched-enum", "training.lr_scheduler", "cosin", "training.lr_scheduler"),
    ("precision-enum", "training.mixed_precision", "fp8", "training.mixed_precision"),
    ("accum-zero", "training.gradient_accumulation", 0, "training.gradient_accumulation"),
    ("clip-neg", "training.grad_clip", -1.0, "training.grad_clip"),
    ("engine-enum", "training.engine", "turbo", "training.engine"),
    ("vram-bad", "training.vram", "lots", "training.vram"),
    ("training-typo", "training.warmup_step", 3, "training.warmup_step"),
    ("refresh-neg", "monitoring.terminal", {"refresh_rate": -1}, "monitoring.terminal.refresh_rate"),
    ("alert-action", "monitoring.alerts", [{"condition": "loss > 1", "action": "explode"}],
     "monitoring.alerts[0].action"),
    ("alert-no-cond", "monitoring.alerts", [{"action": "stop"}], "monitoring.alerts[0].condition"),
    ("tags-list", "monitoring.tracking", {"tags": ["a"]}, "monitoring.tracking.tags"),
    ("top-typo", "trainig", {"epochs": 1}, "trainig"),
    # experiment names that apply's recorder refuses fail validate already (issue 24 item 21)
    ("experiment-traversal", "monitoring.tracking", {"experiment": "evil/../x"}, "monitoring.tracking.experiment"),
    ("experiment-escape", "monitoring.tracking", {"experiment": "a\x1b[2Jb"}, "monitoring.tracking.experiment"),
    ("experiment-dotdot", "monitoring.tracking", {"experiment": "a..b"}, "monitoring.tracking.experiment"),
]


def dump(doc, path):
    yaml = YAML()
    with open(path, "w") as f:
        yaml.dump(doc, f)


def check_error_output(result, expected_path: str | None):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    doc = json.loads(result.stdout)
    assert doc["valid"] is False and doc["findings"]
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert errors
    if expected_path is not None:
        hits = [f for f in errors if f["path"] == expected_path]
        assert hits, f"no finding names {expected_path}: {errors}"
        assert all(isinstance(f["line"], int) and f["line"] >= 1 for f in hits)
        assert hits[0]["file"].endswith("cfg.yaml")
    return errors


@pytest.mark.parametrize("case", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_schema_mutation_fails_with_path_and_line(tmp_path, case):
    _, path, value, expected_path = case
    cfg = tmp_path / "cfg.yaml"
    dump(set_path(base(), path, value), cfg)
    result = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    check_error_output(result, expected_path)


RAW_CASES = [
    ("empty-file", "", None, 1),
    ("only-comment", "# nothing here\n", None, 1),
    ("scalar-doc", "42\n", None, 1),
    ("list-doc", "- a\n- b\n", None, 1),
    ("tab-indent", "model:\n\tarchitecture: {}\n", None, 2),
    ("unclosed-flow", "model: {architecture: [1, 2\n", None, 2),
    ("bad-indent", "model:\n  a: 1\n b: 2\n", None, 3),
    ("duplicate-key", "data: {}\ndata: {}\n", None, 2),
]


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_broken_yaml_fails_with_line(tmp_path, case):
    _, text, _, line = case
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    errors = check_error_output(runner.invoke(app, ["train", "validate", str(cfg), "--json"]), None)
    assert errors[0]["line"] == line


def test_missing_file_and_directory_fail_cleanly(tmp_path):
    for target, code in ((tmp_path / "nope.yaml", "file.missing"), (tmp_path, "file.directory")):
        result = runner.invoke(app, ["train", "validate", str(target), "--json"])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert json.loads(result.stdout)["findings"][0]["code"] == code


def test_non_utf8_file_fails_cleanly(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(b"model: \xff\xfe\n")
    result = runner.invoke(app, ["train", "validate", str(cfg)])
    assert result.exit_code == 1 and "UTF-8" in result.output and "Traceback" not in result.output


def test_at_least_fifty_malformed_kinds():
    assert len(MUTATIONS) + len(RAW_CASES) + 3 >= 50
