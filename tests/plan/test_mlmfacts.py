"""The masked-LM objective's checks (apr/plan/mlmfacts.py): `apr train validate` refuses each
combination that cannot work at its key path, with the reason, and accepts a runnable one."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()

BASE = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    intermediate_size: 128\n    vocab_size: 256\n"
        "    max_position_embeddings: 64\n"
        "data:\n  train: t/\n  val: v/\n  batch_size: 2\n  seq_len: 32\n"
        "training:\n  max_steps: 100\n  eval_interval: 10\n")


def _validate(tmp_path, training: str, extra: str = ""):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + training + extra)
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert "Traceback" not in r.stdout
    return r.exit_code, [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.mlm"]


def test_an_mlm_run_on_autograd_is_valid(tmp_path):
    code, found = _validate(tmp_path, "  engine: standard\n  mode: mlm\n  mlm: {mask_rate: 0.2, mask_token_id: 3}\n")
    assert (code, found) == (0, [])


def test_the_flat_buffer_walk_is_refused_with_its_reason(tmp_path):
    code, found = _validate(tmp_path, "  mode: mlm\n  mlm: {mask_token_id: 3}\n")
    assert code == 1 and [f["path"] for f in found] == ["training.engine"]
    assert "fuses the causal-LM loss" in found[0]["message"] and found[0]["expected"] == "training.engine: standard"


def test_the_mode_and_its_section_go_together(tmp_path):
    code, found = _validate(tmp_path, "  engine: standard\n  mode: mlm\n")
    assert code == 1 and [f["path"] for f in found] == ["training.mode"]
    code, found = _validate(tmp_path, "  engine: standard\n  mlm: {mask_token_id: 3}\n")
    assert code == 1 and [f["path"] for f in found] == ["training.mlm"] and found[0]["got"] == "causal_lm"


def test_a_mask_token_outside_the_vocabulary_and_left_to_right_features_are_refused(tmp_path):
    code, found = _validate(tmp_path, "  engine: standard\n  mode: mlm\n  mlm: {mask_token_id: 256}\n"
                            "  sharding: full\n  world_size: 2\n",
                            "evaluation:\n  samples:\n    prompts: [hello]\n")
    assert code == 1  # FSDP2 sharding runs it (tests/distributed/test_custom_ranks.py): not refused
    assert {f["path"] for f in found} == {"training.mlm.mask_token_id", "evaluation"}
    by_path = {f["path"]: f for f in found}
    assert by_path["training.mlm.mask_token_id"]["got"] == "256"
    assert "(256)" in by_path["training.mlm.mask_token_id"]["expected"]
