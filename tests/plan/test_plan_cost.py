"""Issue 16 item 5: `training.price_per_gpu_hour` / `apr train plan --price` give the run's total
cost and cost per billion tokens; a price that is not a positive number is a clear error, exit 1."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.plan.build import build_plan
from apr.plan.examples import materialize
from apr.plan.render import render_text

runner = CliRunner()


def _plan(tmp_path, training=None, world_size=None, **target):
    example = {"config": {"training": training or {}}, "target": target}
    if world_size:
        example["world_size"] = world_size
    cfg, kw = materialize(example, tmp_path / "run")
    return cfg, build_plan(cfg, **kw)


def test_cost_is_the_estimated_gpu_hours_times_the_price(tmp_path):
    _, plan = _plan(tmp_path, {"price_per_gpu_hour": 2.5}, gpu="h100", world_size=2)
    cost, te, st = plan.to_dict()["cost"], plan.time_estimate, plan.facts["storage"]
    seconds = te["estimated_seconds"] + st["blocking_seconds"]  # the GPUs are billed while training waits for the disk
    assert cost["known"] and cost["gpus"] == 2
    assert cost["gpu_hours"] == pytest.approx(seconds * 2 / 3600)
    assert cost["total"] == pytest.approx(seconds * 2 / 3600 * 2.5)
    assert cost["per_billion_tokens"] == pytest.approx(cost["total"] / te["tokens"] * 1e9)
    text = render_text(plan)
    assert "Cost (estimate)" in text and f"at 2.5 per GPU-hour: {cost['total']:.3g}" in text  # under 1: 3 digits


def test_without_a_time_estimate_the_cost_is_unknown_and_says_why(tmp_path):
    _, plan = _plan(tmp_path, {"price_per_gpu_hour": 2.5, "device": "cuda"})
    cost = plan.facts["cost"]
    assert cost["known"] is False and "total" not in cost and "no GPU is named" in cost["reason"]
    assert "at 2.5 per GPU-hour: unknown, no time estimate" in render_text(plan)


def test_no_price_no_cost(tmp_path):
    _, plan = _plan(tmp_path, gpu="h100")
    assert plan.to_dict()["cost"] is None and "Cost (estimate)" not in render_text(plan)


def test_price_on_the_command_line_overrides_the_config(tmp_path):
    cfg, _ = _plan(tmp_path, {"price_per_gpu_hour": 1.0})
    r = runner.invoke(app, ["train", "plan", str(cfg), "--gpu", "a100", "--price", "4", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["cost"]["price_per_gpu_hour"] == 4.0 and doc["config"]["training"]["price_per_gpu_hour"] == 4.0


@pytest.mark.parametrize("price", ["abc", "-1", "0", "nan", "inf", ""])
def test_a_bad_price_option_is_a_clear_error_exit_1(tmp_path, price):
    cfg, _ = _plan(tmp_path)
    r = runner.invoke(app, ["train", "plan", str(cfg), "--price", price])
    assert r.exit_code == 1, r.output
    assert f"--price must be a positive number (the price of one GPU for one hour), got {price!r}" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("value, code", [("abc", "schema.float_type"), ("-2", "schema.greater_than"),
                                         ("true", "schema.value_error"), (".inf", "schema.finite_number")])
def test_a_bad_price_in_the_config_fails_validate_and_plan_at_its_line(tmp_path, value, code):
    cfg, _ = _plan(tmp_path, {"price_per_gpu_hour": 1.5})
    text = cfg.read_text()
    assert "price_per_gpu_hour: 1.5" in text
    cfg.write_text(text.replace("price_per_gpu_hour: 1.5", f"price_per_gpu_hour: {value}"))
    line = next(i for i, ln in enumerate(cfg.read_text().splitlines(), 1) if "price_per_gpu_hour" in ln)
    for command in ("validate", "plan"):
        r = runner.invoke(app, ["train", command, str(cfg)])
        assert r.exit_code == 1, r.output
        assert f"error[{code}] {cfg}:{line}:" in r.output and "training.price_per_gpu_hour" in r.output
        assert "Traceback" not in r.output


def test_the_ci_step_summary_carries_the_cost_and_the_checkpoints(tmp_path):
    from apr.plan.render import github_facts

    _, plan = _plan(tmp_path, {"price_per_gpu_hour": 2.5}, gpu="h100")
    facts = dict(github_facts(plan))
    assert facts["cost"].startswith(f"~{plan.facts['cost']['total']:.3g} (") and "per billion tokens" in facts["cost"]
    assert facts["checkpoints"].startswith(f"{plan.facts['storage']['written']['max']} x ")
