"""training.output_dir a run must not write into, and model.path (accepted and ignored before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import load_config
from apr.config.paths import output_dir_problems
from apr.errors import ConfigError

runner = CliRunner()

CONFIG = """\
model:
  architecture: {{hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, intermediate_size: 128,
                 vocab_size: 512, max_position_embeddings: 64}}
data:
  train: {train}
  val: {val}
  tokenizer: {tok}
  batch_size: 2
  seq_len: 32
training:
  output_dir: {out}
"""


def _config(tmp_path: Path, out: str, train="data/train", val="data/val", tok="tok/tokenizer.json") -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(train=train, val=val, tok=tok, out=json.dumps(out)))
    return path


@pytest.mark.parametrize(("out", "needle"), [
    ("/", "filesystem root"), ("~", "home folder"), ("data/train", "is data.train"), ("data", "holds data.train"),
    ("data/val/run", "inside data.val"), ("tok", "holds data.tokenizer"), ("tok/tokenizer.json", "is data.tokenizer"),
])
def test_output_dirs_that_would_mix_with_inputs_fail_validate_at_their_line(tmp_path, monkeypatch, out, needle):
    monkeypatch.chdir(tmp_path)
    cfg = _config(tmp_path, out)
    result = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert result.exit_code == 1, result.output
    findings = [f for f in json.loads(result.stdout)["findings"] if f["code"] == "config.output_dir"]
    assert findings and any(needle in f["message"] for f in findings)
    assert all(f["path"] == "training.output_dir" and f["line"] == 11 for f in findings)
    assert not (tmp_path / "data").exists()  # validate wrote nothing


def test_an_ordinary_output_dir_is_fine(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert output_dir_problems(load_config(_config(tmp_path, "runs/a")).config) == []
    # a symlink that resolves into the data is caught too
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data" / "train")
    assert output_dir_problems(load_config(_config(tmp_path, "link")).config)


def test_model_path_other_than_scratch_is_refused_with_the_way_to_resume(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    text = _config(tmp_path, "runs/a").read_text()
    cfg.write_text(text.replace("model:\n", "model:\n  path: runs/old/checkpoint-best.json\n"))
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    f = e.value.findings[0]
    assert f.path == "model.path" and f.line == 2
    assert "--resume latest" in f.message and "model.init_from" in f.message
    cfg.write_text(cfg.read_text().replace("runs/old/checkpoint-best.json", '"."'))
    assert load_config(cfg).config.model.path == "."
