from pathlib import Path

import pytest

from apr.config import config_hash, load_config
from apr.config.schema import AprConfig
from apr.errors import ConfigError

MINIMAL = """\
model:
  architecture:
    hidden_size: 64
    num_hidden_layers: 2
    num_attention_heads: 4
    intermediate_size: 128
    vocab_size: 512
    max_position_embeddings: 64
data:
  train: data/train
  batch_size: 2
  seq_len: 32
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_every_shipped_config_loads(shipped_configs):
    assert len(shipped_configs) >= 3
    for path in shipped_configs:
        loaded = load_config(path)
        assert isinstance(loaded.config, AprConfig)


def test_reference_350m_values_survive_loading(repo):
    cfg = load_config(repo / "configs/train/pretrain-350m-v2.yaml").config
    arch = cfg.model.architecture
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.kv_heads) == (1024, 24, 16, 4)
    assert arch.vocab_size == 32768 and arch.intermediate_size == 4096
    assert (cfg.data.batch_size, cfg.data.seq_len) == (4, 1024)
    assert (cfg.training.max_steps, cfg.training.warmup_steps, cfg.training.save_interval) == (5000, 500, 25)
    assert str(cfg.training.mixed_precision) == "fp16"
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.optimizer.beta2 == pytest.approx(0.95)
    assert [a.condition for a in cfg.monitoring.alerts] == ["loss > 10", "grad_norm > 100"]


def test_defaults_fill_omitted_sections(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL)).config
    assert cfg.model.architecture.kv_heads == 4  # MHA when num_key_value_heads is omitted
    assert cfg.optimizer.resolved_min_lr == pytest.approx(cfg.optimizer.lr * 0.1)
    assert cfg.training.gradient_accumulation == 1 and cfg.training.epochs == 1
    assert cfg.monitoring.terminal.refresh_rate == 1000


def test_shorthand_counts_in_a_config(tmp_path):
    text = MINIMAL.replace("vocab_size: 512", "vocab_size: 32K").replace("seq_len: 32", "seq_len: 1_024")
    cfg = load_config(write(tmp_path, text)).config
    assert cfg.model.architecture.vocab_size == 32_000 and cfg.data.seq_len == 1024


def test_errors_carry_path_line_column_expected_and_got(tmp_path):
    text = MINIMAL.replace("batch_size: 2", "batch_size: two")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    (f,) = info.value.findings
    assert f.path == "data.batch_size" and f.line == 11 and f.column == 3
    assert f.got == "'two'" and "count" in f.expected
    assert f.file.endswith("cfg.yaml")


def test_several_errors_are_reported_together(tmp_path):
    text = MINIMAL.replace("batch_size: 2", "batch_size: -2").replace("hidden_size: 64", "hidden_sise: 64")
    text += "training:\n  lr_scheduler: cosin\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    paths = {f.path for f in info.value.findings}
    assert {"data.batch_size", "model.architecture.hidden_sise", "model.architecture.hidden_size",
            "training.lr_scheduler"} <= paths


def test_unknown_key_suggests_the_close_one(tmp_path):
    text = MINIMAL + "training:\n  warmup_step: 10\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    (f,) = info.value.findings
    assert f.code == "schema.unknown_key" and "did you mean 'warmup_steps'" in f.message
    assert f.line == 14


def test_duplicate_keys_are_a_syntax_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL + "data:\n  train: x\n"))
    assert info.value.findings[0].code == "yaml.syntax" and info.value.findings[0].line is not None


def test_config_hash_ignores_key_order_and_comments(tmp_path):
    a = load_config(write(tmp_path, MINIMAL, "a.yaml"))
    lines = MINIMAL.splitlines()
    reordered = "\n".join(lines[8:] + lines[:8]) + "\n# a comment\n"
    b = load_config(write(tmp_path, reordered, "b.yaml"))
    assert a.config_hash == b.config_hash == config_hash(b.config)
    c = load_config(write(tmp_path, MINIMAL.replace("seq_len: 32", "seq_len: 64"), "c.yaml"))
    assert c.config_hash != a.config_hash
