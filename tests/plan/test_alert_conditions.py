"""Alert conditions apply would reject are caught by validate and plan, located at their line."""

from __future__ import annotations

import subprocess
import sys

CONFIG = """\
model:
  architecture: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 64,
                 vocab_size: 64, max_position_embeddings: 16}
data: {train: data/train, batch_size: 4, seq_len: 16}
training: {device: cpu, max_steps: 4}
monitoring:
  alerts:
    - condition: "loss > 10"
    - condition: "los > 1"
    - condition: "loss >"
    - condition: "loss"
"""


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "apr", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_validate_and_plan_report_every_bad_alert_at_its_line(tmp_path):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    for cmd in (["train", "validate", "cfg.yaml"], ["train", "plan", "cfg.yaml"]):
        proc = _run(*cmd, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in out, out
        assert "alert.unknown_metric" in out and "cfg.yaml:9:" in out and "los" in out
        assert "alert.invalid_condition" in out and "cfg.yaml:10:" in out
        assert "alert.not_boolean" in out and "cfg.yaml:11:" in out
        assert "alerts[0]" not in out  # the good one is not reported


def test_good_alerts_pass_validate(tmp_path):
    good = CONFIG.split("    - condition: \"los >")[0]
    (tmp_path / "cfg.yaml").write_text(good)
    assert _run("train", "validate", "cfg.yaml", cwd=tmp_path).returncode == 0


def test_a_block_norm_alert_with_block_norms_off_fails_validate_at_its_line(tmp_path):
    config = CONFIG.split("  alerts:")[0] + (
        "  block_norms: false\n"
        "  alerts:\n"
        "    - condition: \"block_grad_norm.exists(x, x > 5.0)\"\n")
    (tmp_path / "cfg.yaml").write_text(config)
    proc = _run("train", "validate", "cfg.yaml", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert "alert.block_norms_off" in out and "cfg.yaml:9:" in out and "monitoring.block_norms" in out
    (tmp_path / "cfg.yaml").write_text(config.replace("block_norms: false", "block_norms: true"))
    assert _run("train", "validate", "cfg.yaml", cwd=tmp_path).returncode == 0
