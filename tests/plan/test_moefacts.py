"""The mixture of experts' checks (apr/plan/moefacts.py): `apr train validate` refuses each
combination that cannot work at its key path, with the reason, and accepts a runnable one; the plan
counts the parameters a token uses."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()

BASE = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    intermediate_size: 128\n    vocab_size: 256\n"
        "    max_position_embeddings: 64\n    moe: {num_experts: 4, top_k: 2, expert_intermediate_size: 32}\n")
DATA = "data:\n  train: t/\n  val: v/\n  batch_size: 2\n  seq_len: 32\n"


def _validate(tmp_path, training: str, model: str = ""):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + model + DATA + "training:\n  max_steps: 100\n  eval_interval: 10\n" + training)
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert "Traceback" not in r.stdout
    doc = json.loads(r.stdout)
    return r.exit_code, [f for f in doc["findings"] if f["code"] == "config.moe"], doc


def test_experts_on_autograd_are_valid(tmp_path):
    code, found, _ = _validate(tmp_path, "  engine: standard\n")
    assert (code, found) == (0, [])


def test_the_flat_buffer_walk_is_refused_with_its_reason(tmp_path):
    code, found, _ = _validate(tmp_path, "  engine: interleaved\n")
    assert code == 1 and [f["path"] for f in found] == ["training.engine"]
    assert "load-balancing loss" in found[0]["message"] and found[0]["expected"] == "training.engine: standard"
    assert found[0]["line"] is not None


def test_what_reads_the_dense_mlp_is_refused_at_its_key(tmp_path):
    code, found, _ = _validate(tmp_path, "  engine: standard\n  execution: {compile: true}\n",
                               "  lora: {rank: 4}\n  init_from: somewhere/\n")
    assert code == 1
    assert {f["path"] for f in found} == {"model.lora", "model.init_from", "training.execution.compile"}


def test_top_k_above_the_experts_is_a_schema_error_at_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE.replace("top_k: 2", "top_k: 5") + DATA + "training:\n  engine: standard\n")
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    found = json.loads(r.stdout)["findings"]
    assert r.exit_code == 1 and any("top_k is 5, more than num_experts 4" in f["message"] for f in found)
