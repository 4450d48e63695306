"""Multi-head latent attention's checks (apr/plan/mlafacts.py and the schema's attention section):
`apr train validate` refuses each incoherent value or combination at its key path with the reason,
accepts a runnable one, and the plan counts the latent projections and shows the KV cache."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()

ARCH = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    intermediate_size: 128\n    vocab_size: 256\n    max_position_embeddings: 64\n")
MLA = "    attention: {kind: mla, kv_lora_rank: 16, qk_rope_head_dim: 8}\n"
DATA = "data:\n  train: t/\n  val: v/\n  batch_size: 2\n  seq_len: 32\n"


def _validate(tmp_path, arch: str = MLA, rest: str = ""):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ARCH + arch + DATA + "training:\n  max_steps: 100\n  eval_interval: 10\n" + rest)
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert "Traceback" not in r.stdout
    return r.exit_code, json.loads(r.stdout)["findings"]


@pytest.mark.parametrize("engine", ["interleaved", "standard"])
def test_latent_attention_is_valid_on_both_gradient_sources(tmp_path, engine):
    assert _validate(tmp_path, rest=f"  engine: {engine}\n") == (0, [])


@pytest.mark.parametrize(("attention", "key", "words"), [
    ("{kind: mla, kv_lora_rank: 0, qk_rope_head_dim: 8}", "model.architecture.attention.kv_lora_rank", ""),
    ("{kind: mla, kv_lora_rank: 16, qk_rope_head_dim: 7}", "model.architecture.attention", "must be even"),
    ("{kind: mla, kv_lora_rank: 16, qk_rope_head_dim: 18}", "model.architecture.attention", "wider than a head"),
    ("{kind: mla, kv_lora_rank: 16}", "model.architecture.attention", "no qk_rope_head_dim"),
    ("{kind: gqa, kv_lora_rank: 16}", "model.architecture.attention", "expected kind: mla"),
    ("{kind: flash}", "model.architecture.attention.kind", ""),
])
def test_an_incoherent_attention_section_is_refused_at_its_key(tmp_path, attention, key, words):
    code, found = _validate(tmp_path, f"    attention: {attention}\n")
    assert code == 1 and [f["path"] for f in found if f["severity"] == "error"] == [key]
    assert words in found[0]["message"] and found[0]["line"] == 9


def test_options_latent_attention_cannot_work_with_are_refused_at_their_keys(tmp_path):
    code, found = _validate(tmp_path, MLA + "    num_key_value_heads: 2\n    family: mistral\n"
                            "    rope_scaling: {rope_type: yarn, factor: 2}\n", "  engine: standard\n")
    mla = {f["path"]: f for f in found if f["code"] == "config.mla"}
    assert code == 1 and set(mla) == {"model.architecture.num_key_value_heads", "model.architecture.family",
                                      "model.architecture.rope_scaling.rope_type"}
    assert "own key and value" in mla["model.architecture.num_key_value_heads"]["message"]
    assert mla["model.architecture.family"]["got"] == "mistral" and mla["model.architecture.family"]["line"] == 11


def test_what_reads_the_standard_projections_is_refused_with_the_reason(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ARCH.replace("model:\n", f"model:\n  lora: {{rank: 4}}\n  init_from: {folder}\n") + MLA + DATA
                   + "training:\n  max_steps: 100\n  eval_interval: 10\n")
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    mla = {f["path"]: f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.mla"}
    assert r.exit_code == 1 and {"model.lora", "model.init_from"} <= set(mla)
    assert "DeepSeek MLA folder is not imported" in mla["model.init_from"]["message"]


def test_the_plan_counts_the_latent_projections_and_shows_the_kv_cache(tmp_path):
    from apr.plan.configfacts import model_facts
    from tests.train.tiny import make_config

    mla = make_config(model={"architecture": {"num_key_value_heads": None, "attention": {
        "kind": "mla", "kv_lora_rank": 6, "qk_rope_head_dim": 4, "q_lora_rank": 8}}})
    gqa = make_config()
    got, dense = model_facts(mla), model_facts(gqa)
    # h 32, 4 heads of 8 (4 position-free + 4 RoPE): q 32->8->32, kv 32->6+4, expand 6->4x(4+8), o 32x32
    attention = 8 * 32 + 8 + 32 * 8 + (6 + 4) * 32 + 6 + 4 * (4 + 8) * 6 + 32 * 32
    assert got["block_params"] - dense["block_params"] == attention - (32 * 32 + 16 * 32 + 16 * 32 + 32 * 32)
    assert got["mla"] == {"kv_lora_rank": 6, "qk_rope_head_dim": 4, "q_lora_rank": 8}
    assert got["kv_cache_bytes_per_token"] == 3 * (6 + 4) * 4 and dense["kv_cache_bytes_per_token"] == 3 * 2 * 16 * 4
    assert got["flops_per_token"] - dense["flops_per_token"] == 6 * 3 * (got["block_params"] - dense["block_params"])
