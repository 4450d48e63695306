"""`apr data synth --like CONFIG`: stand-in data so the 350M reference config plans end to end on a
fresh clone (issue 24 item 11)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "train" / "pretrain-350m-v2.yaml"


def test_the_350m_config_plans_end_to_end_on_its_stand_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = runner.invoke(app, ["train", "plan", str(CONFIG), "--json"])
    assert missing.exit_code == 1  # a fresh clone has no corpus: the reason for the command
    t0 = time.monotonic()
    made = runner.invoke(app, ["data", "synth", "--like", str(CONFIG), "--out", "standin"])
    seconds = time.monotonic() - t0
    assert made.exit_code == 0, made.output
    assert "20,000 sequences x 1,025 tokens" in made.output and "32,768 tokens" in made.output
    size = sum(p.stat().st_size for p in (tmp_path / "standin").rglob("*") if p.is_file())
    assert size < 20 * 2**20, size
    monkeypatch.chdir(tmp_path / "standin")
    result = runner.invoke(app, ["train", "plan", str(CONFIG), "--gpu", "4090", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["errors"] == 0
    # the one warning: save_interval 25 writes 200 checkpoints of ~5 GiB (the storage plan, C-DISK-002)
    assert [f["code"] for f in doc["findings"] if f["severity"] == "warning"] == ["C-DISK-002"]
    facts = doc["facts"]
    assert facts["data"]["train"]["sequences"] == 20_000 and facts["data"]["train"]["row_len"] == 1025
    assert facts["data"]["train"]["max_token_id"] == 32_767
    assert seconds < 30  # it must stay cheap; measured ~0.5 s on the 2-core box


def test_synth_refuses_to_replace_existing_data_without_overwrite(tmp_path):
    out = tmp_path / "standin"
    assert runner.invoke(app, ["data", "synth", "--like", str(CONFIG), "--out", str(out),
                               "--train-rows", "8"]).exit_code == 0
    result = runner.invoke(app, ["data", "synth", "--like", str(CONFIG), "--out", str(out)])
    assert result.exit_code == 1 and "--overwrite" in result.output and "Traceback" not in result.output
    train = out / "data" / "pretokenized-2048-v2" / "train"
    (train / "notes.md").write_text("mine")
    result = runner.invoke(app, ["data", "synth", "--like", str(CONFIG), "--out", str(out), "--overwrite"])
    assert result.exit_code == 1 and "did not write" in result.output
    assert (train / "notes.md").read_text() == "mine"
