"""The plan's drift check: a val set drawn from another distribution than train is a warning at
data.val's line (exit 1 under --strict); one from the same distribution, or too small to judge, is
only a fact the plan prints."""

from __future__ import annotations

import json

from plan_helpers import plan_for
from typer.testing import CliRunner

from apr.cli.main import app

ROWS = {"rows": 400}  # 400 rows of 33 tokens: 13,200 per side, above the check's 10,000


def test_val_from_another_distribution_is_a_warning_at_its_line(tmp_path):
    plan = plan_for({"train": ROWS, "val": {**ROWS, "max_token": 20}}, tmp_path)
    (warning,) = [f for f in plan.findings if f.code == "data.drift"]
    assert warning.severity == "warning" and warning.path == "data.val" and warning.line is not None
    assert "looks drawn from another distribution" in warning.message and "token_rank PSI" in warning.message
    (fact,) = plan.facts["data_drift"]
    assert fact["judged"] and fact["drifted"] and fact["stats"][0]["n_current"] == 13_200
    result = CliRunner().invoke(app, ["train", "plan", str(plan.config_path), "--strict"])
    assert result.exit_code == 1 and "data.drift" in result.output
    assert "DRIFT" in CliRunner().invoke(app, ["train", "plan", str(plan.config_path)]).stdout


def test_same_distribution_and_small_samples_are_facts_not_findings(tmp_path):
    same = plan_for({"train": ROWS, "val": ROWS}, tmp_path / "same")
    assert not [f for f in same.findings if f.code.startswith("data.drift")]
    (fact,) = same.facts["data_drift"]
    assert fact["judged"] and not fact["drifted"] and fact["stats"][0]["ks"] < 0.2
    small = plan_for({"val": {"max_token": 20}}, tmp_path / "small")  # 528 tokens a side: noise
    (fact,) = small.facts["data_drift"]
    assert not fact["judged"] and not [f for f in small.findings if f.code == "data.drift"]


def test_the_check_can_be_turned_off_and_its_threshold_moved(tmp_path):
    off = plan_for({"train": ROWS, "val": {**ROWS, "max_token": 20}, "config": {"data": {"drift": {"enabled": False}}}},
                   tmp_path / "off")
    assert "data_drift" not in off.facts and not [f for f in off.findings if f.code == "data.drift"]
    lax = plan_for({"train": ROWS, "val": ROWS, "config": {"data": {"drift": {"ks_warning": 0.001}}}}, tmp_path / "lax")
    assert [f.code for f in lax.findings if f.code == "data.drift"] == ["data.drift"]
    doc = json.loads(CliRunner().invoke(app, ["train", "plan", str(lax.config_path), "--json"]).stdout)
    assert doc["facts"]["data_drift"][0]["val"] == "data.val"
