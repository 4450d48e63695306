"""What the plan prints about counts and numbers (issue 24 item 11)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app
from apr.plan.build import build_plan
from apr.plan.examples import materialize

runner = CliRunner()


def test_info_findings_are_not_counted_as_failed_contracts(tmp_path):
    cfg, _ = materialize({}, tmp_path / "base")
    plan = build_plan(cfg)
    info = [r for r in plan.results if r.status == "failed" and r.finding.severity == "info"]
    s = plan.summary()
    assert s["failed"] == s["errors"] + s["warnings"]
    assert s["noted"] == len(info) == s["info"] > 0  # the base example has info findings
    assert s["passed"] + s["failed"] + s["noted"] + s["skipped"] == s["contracts"]
    doc = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)
    assert doc["summary"]["failed"] == doc["summary"]["errors"] + doc["summary"]["warnings"]


def test_min_lr_is_printed_without_float_noise(tmp_path):
    cfg, _ = materialize({"config": {"optimizer": {"lr": 3.0e-4, "min_lr": None}}}, tmp_path / "base")
    out = runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout
    assert "2.9999999999999997e-05" not in out and "3e-05" in out


def test_a_tied_model_is_not_described_as_all_non_embedding(tmp_path):
    cfg, _ = materialize({"config": {"model": {"architecture": {"tie_word_embeddings": True}}}}, tmp_path / "base")
    text = runner.invoke(app, ["train", "plan", str(cfg)]).stdout
    line = next(li for li in text.splitlines() if "parameters:" in li)
    assert "non-embedding" not in line
    assert "in the blocks" in line and "embedding tied to the LM head" in line
