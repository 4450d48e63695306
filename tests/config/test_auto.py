"""`auto` layout keys (apr/config/auto.py): taken out by the loader, stand-ins that keep the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import load_config
from apr.errors import ConfigError

runner = CliRunner()

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
  seq_len: 32
"""


def write(tmp_path: Path, data: str, training: str = "") -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(MINIMAL + "".join(f"  {line}\n" for line in data.splitlines())
                    + ("training:\n" + "".join(f"  {line}\n" for line in training.splitlines()) if training else ""))
    return path


@pytest.mark.parametrize(("data", "training", "batch", "accumulation"), [
    ("batch_size: auto\nglobal_batch_size: 32", "gradient_accumulation: auto", 1, 32),
    ("batch_size: 4\nglobal_batch_size: 32", "gradient_accumulation: auto", 4, 8),
    ("batch_size: auto\nglobal_batch_size: 32", "gradient_accumulation: 2", 16, 2),
    ("batch_size: auto\nglobal_batch_size: 32", "gradient_accumulation: auto\nworld_size: 4", 1, 8),
])
def test_counts_stand_in_at_the_global_batch(tmp_path, data, training, batch, accumulation):
    loaded = load_config(write(tmp_path, data, training))
    config = loaded.config
    assert (config.data.batch_size, config.training.gradient_accumulation) == (batch, accumulation)
    assert config.data.batch_size * config.training.gradient_accumulation * config.training.world_size == 32
    assert set(loaded.auto) == {key for key, text in (("data.batch_size", data), ("training.gradient_accumulation",
                                                                                   training)) if "auto" in text}


def test_sharding_auto_stands_in_as_none(tmp_path):
    loaded = load_config(write(tmp_path, "batch_size: 2", "sharding: auto\nworld_size: 2"))
    assert loaded.auto == ("training.sharding",) and str(loaded.config.training.sharding) == "none"
    # a setting replaces the auto: nothing is left to fit
    loaded = load_config(write(tmp_path, "batch_size: 2", "sharding: auto"), {"training.sharding": "full"})
    assert loaded.auto == () and str(loaded.config.training.sharding) == "full"


def test_a_stated_global_batch_must_be_the_counts_product(tmp_path):
    assert load_config(write(tmp_path, "batch_size: 4\nglobal_batch_size: 8", "gradient_accumulation: 2")).auto == ()
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "batch_size: 4\nglobal_batch_size: 10", "gradient_accumulation: 2"))
    finding = err.value.findings[0]
    assert finding.path == "data.global_batch_size" and finding.line == 13
    assert "make 8" in finding.message and finding.got == "10"


def test_auto_counts_need_a_global_batch_that_splits(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "batch_size: auto"))
    finding = err.value.findings[0]
    assert finding.path == "data.batch_size" and finding.line == 12
    assert "needs data.global_batch_size" in finding.message
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "batch_size: 4\nglobal_batch_size: 30", "gradient_accumulation: auto"))
    finding = err.value.findings[0]
    assert finding.path == "data.global_batch_size" and "28 or 32" in finding.message


def test_auto_on_a_key_the_plan_does_not_fit_is_refused_at_the_key(tmp_path):
    path = write(tmp_path, "batch_size: 2", "max_steps: auto")
    result = runner.invoke(app, ["train", "validate", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cfg.yaml:14:3 training.max_steps" in result.output
    assert "auto is not a value training.max_steps takes: the plan fits only data.batch_size" in result.output
