"""Time conditioning's checks (apr/plan/timefacts.py and the schema's own): `apr train validate`
refuses each combination that cannot work at its key path, with the reason, and accepts runnable
ones."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()

BASE = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    intermediate_size: 128\n    vocab_size: 256\n"
        "    max_position_embeddings: 64\n    time: {TIME}\n"
        "data:\n  train: t/\n  val: v/\n  batch_size: 2\n  seq_len: 32\n"
        "training:\n  max_steps: 100\n  eval_interval: 10\n")
STACKING = "  stacking:\n    stages: [{blocks: 1, steps: 50}, {blocks: 2}]\n"


def _validate(tmp_path, time: str, training: str = "  engine: standard\n", model: str = ""):
    cfg = tmp_path / "c.yaml"
    text = BASE.replace("{TIME}", time) + training
    cfg.write_text(text.replace("data:\n", model + "data:\n", 1))
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert "Traceback" not in r.stdout
    findings = json.loads(r.stdout)["findings"]
    return r.exit_code, [f for f in findings if f["code"] == "config.time"], findings


def test_time_as_input_and_time_as_depth_on_autograd_are_valid(tmp_path):
    assert _validate(tmp_path, "{embedding_dim: 16, encoding: learned, eval_time: 0.25}")[:2] == (0, [])
    assert _validate(tmp_path, "{embedding_dim: 16, interpretation: depth, stack_time_mapping: exponential, "
                     "time_per_stack: 100}", model=STACKING)[:2] == (0, [])
    masked = "  engine: standard\n  mode: mlm\n  mlm: {mask_token_id: 3}\n"
    assert _validate(tmp_path, "{embedding_dim: 16, masking: true}", masked)[:2] == (0, [])


def test_the_flat_buffer_walk_is_refused_with_its_reason(tmp_path):
    code, found, _ = _validate(tmp_path, "{embedding_dim: 16}", "  engine: interleaved\n")
    assert code == 1 and [f["path"] for f in found] == ["training.engine"]
    assert "drop the time embedding's gradient" in found[0]["message"]
    assert found[0]["expected"] == "training.engine: standard" and found[0]["line"] == 19


def test_depth_without_stages_masking_without_the_masked_lm_and_the_trunk_cache_are_refused(tmp_path):
    code, found, _ = _validate(tmp_path, "{embedding_dim: 16, interpretation: depth, time_per_stack: 10, "
                               "masking: true}")
    assert code == 1 and [f["path"] for f in found] == ["model.architecture.time.interpretation",
                                                        "model.architecture.time.masking"]
    assert "no stages" in found[0]["message"] and found[1]["got"] == "training.mode: causal_lm"
    cached = ("  stacking:\n    stages: [{blocks: 1, steps: 50}, {blocks: 2}]\n    earlier: freeze\n"
              "    freeze_embedding: true\n    cache_activations: true\n")
    code, found, _ = _validate(tmp_path, "{embedding_dim: 16}", model=cached)
    assert code == 1 and "model.stacking.cache_activations" in [f["path"] for f in found]


def test_the_schema_refuses_keys_of_the_other_interpretation_and_an_odd_sinusoid(tmp_path):
    for time, words in (("{embedding_dim: 15}", "even embedding_dim"),
                        ("{embedding_dim: 16, time_per_stack: 10}", "expected interpretation: depth"),
                        ("{embedding_dim: 16, interpretation: depth}", "expected time_per_stack"),
                        ("{embedding_dim: 16, eval_time: 1.5}", "less than or equal to 1")):
        code, _, findings = _validate(tmp_path, time)
        assert code == 1 and any(words in f["message"] and f["path"].startswith("model.architecture.time")
                                 for f in findings), (time, findings)
