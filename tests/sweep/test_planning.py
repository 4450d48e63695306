"""Planned before spent (apr/sweep/planning.py): each trial is apr's own plan; invalid trials are
counted with their findings and cost nothing; values the schema refuses are the sweep file's error."""

from __future__ import annotations

import pytest

from apr.fmt import fmt_duration
from apr.sweep.planning import check_base, plan_sweep, plan_trial
from apr.sweep.spec import SweepError, load_sweep
from tests.sweep.sweep_helpers import tiny_root, write_sweep

GRID = """
config: cfg.yaml
method: grid
parameters:
  model.architecture.num_attention_heads: {values: [3, 4, 5, 8]}
  optimizer.lr: {values: [0.01, 0.003]}
"""


def test_a_grid_plan_counts_the_valid_points_and_names_the_findings_of_the_others(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    plan = plan_sweep(load_sweep(write_sweep(tmp_path, GRID)))
    doc = plan.to_dict()
    assert (doc["planned"], doc["valid"], doc["invalid"], doc["sampled"]) == (8, 4, 4, False)
    for t in plan.trials:
        heads = t.settings["model.architecture.num_attention_heads"]
        assert t.valid == (heads in (4, 8))
        if not t.valid:  # 32 / heads leaves a remainder: the architecture contract says so
            assert t.errors[0].code == "C-ARCH-001" and t.reason().startswith("plan: [C-ARCH-001]")
    # tokens of the valid trials only: 12 steps x 4 rows x 16 tokens each
    assert doc["total"]["tokens"] == 4 * 12 * 4 * 16 and doc["total"]["invalid_trials_cost"] == 0
    assert doc["total"]["seconds"] is None  # no GPU named, no probe: the plan does not guess


def test_a_gpu_target_gives_time_and_cost_per_trial_and_in_total(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    spec = load_sweep(write_sweep(tmp_path, GRID))
    plan = plan_sweep(spec, gpu="4090", settings={"training.price_per_gpu_hour": 2.0})
    valid = [t for t in plan.trials if t.valid]
    assert all(t.seconds and t.cost for t in valid)
    total = plan.total()
    assert total["seconds"] == pytest.approx(sum(t.seconds for t in valid))
    assert total["cost"] == pytest.approx(sum(t.cost for t in valid))


def test_a_sample_of_a_random_sweep_is_projected_to_its_run_cap(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    spec = load_sweep(write_sweep(tmp_path, """
config: cfg.yaml
method: random
run_cap: 40
parameters:
  optimizer.lr: {distribution: log_uniform_values, min: 0.001, max: 0.01}
  model.architecture.num_attention_heads: {values: [3, 4]}
"""))
    plan = plan_sweep(spec, sample=8)
    doc = plan.to_dict()
    assert doc["planned"] == 8 and doc["sampled"] and doc["trial_count"] == 40
    share = doc["valid"] / 8
    assert doc["total"]["valid_trials"] == pytest.approx(40 * share)
    assert doc["total"]["tokens"] == pytest.approx(40 * share * 12 * 4 * 16)


def test_a_value_the_schema_refuses_is_the_sweep_files_error_at_its_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    spec = load_sweep(write_sweep(tmp_path, """
config: cfg.yaml
method: grid
parameters:
  optimizer.lr: {values: [0.01, -1.0]}
  training.mixed_precision: {values: [fp32, fp8]}
"""))
    with pytest.raises(SweepError) as info:
        check_base(spec)
    found = {f.path: f for f in info.value.findings}
    assert set(found) == {"parameters.optimizer.lr.values.1", "parameters.training.mixed_precision.values.1"}
    assert found["parameters.optimizer.lr.values.1"].line == 4 and found["parameters.optimizer.lr.values.1"].file \
        .endswith("sweep.yaml")


def test_a_trial_refused_by_the_schema_or_a_contract_is_an_invalid_trial_not_an_exception(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_root(tmp_path)
    schema = plan_trial(cfg, {"data.batch_size": 0})
    assert not schema.valid and schema.tokens is None and schema.errors[0].path == "data.batch_size"
    contract = plan_trial(cfg, {"optimizer.lr": 1e-4, "optimizer.min_lr": 1e-3})
    assert not contract.valid and contract.reason().startswith("plan: [C-")


def test_a_probe_of_the_base_shape_times_its_trials_calibrated_and_the_others_are_named(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from apr import __version__
    from apr.cli.main import app
    from apr.config import load_config
    from apr.plan.facts import cpu_threads
    from apr.track import calibration

    monkeypatch.chdir(tmp_path)
    cfg = tiny_root(tmp_path)
    runner = CliRunner()
    policy = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)["run"]["execution"]["policy"]
    config = load_config(cfg).config
    calibration.record({  # what `apr train plan --probe` records for the base config's shape on this CPU
        "source": "probe", "device": "cpu", "device_name": calibration.host_cpu_name(),
        "versions": {"torch": calibration.torch_version(), "cuda": None, "apr": __version__, "python": "3"},
        "tokens_per_s": 1000.0, "step_seconds": 0.1, "step_seconds_all": [0.09, 0.1, 0.11], "startup_seconds": 2.0,
        "load": 0.5, "threads": 2, "rows": []}, calibration.shape(config, policy, cpu_threads(config, 1)["threads"]))
    # the learning rate leaves the shape alone: both trials are timed from the probe
    lr = plan_sweep(load_sweep(write_sweep(tmp_path, "config: cfg.yaml\nmethod: grid\nparameters:\n"
                                                     "  optimizer.lr: {values: [0.01, 0.003]}\n")))
    assert all(t.valid and t.calibrated and t.seconds > 0 for t in lr.trials)
    total = lr.total()
    assert total["calibrated"] and total["seconds"] == pytest.approx(sum(t.seconds for t in lr.trials))
    # another batch size is another shape: its trials are not timed, and the total says how many
    path = write_sweep(tmp_path, "config: cfg.yaml\nmethod: grid\nparameters:\n  data.batch_size: {values: [4, 2]}\n",
                       "batch.yaml")
    plan = plan_sweep(load_sweep(path))
    timed = {t.settings["data.batch_size"]: t.seconds is not None for t in plan.trials}
    assert timed == {4: True, 2: False} and plan.total()["seconds"] is None and plan.total()["timed"] == 1
    text = runner.invoke(app, ["sweep", "plan", str(path)]).stdout
    assert "time unknown: 1 of 2 valid trials have no probe or finished run of their shape" in text
    text = runner.invoke(app, ["sweep", "plan", "sweep.yaml"]).stdout
    assert f"time {fmt_duration(total['seconds'])} (calibrated)" in text


def test_auto_keys_are_fitted_per_trial_at_its_own_shape_or_the_trial_is_refused(tmp_path, monkeypatch):
    from apr.plan.build import build_plan

    monkeypatch.chdir(tmp_path)
    cfg = tiny_root(tmp_path, data={"batch_size": "auto", "global_batch_size": 8},
                    training={"gradient_accumulation": "auto"})
    spec = load_sweep(write_sweep(tmp_path, "config: cfg.yaml\nmethod: grid\nparameters:\n"
                                            "  data.global_batch_size: {values: [4, 8]}\n"))
    plan = plan_sweep(spec, vram="4GiB")
    assert [t.valid for t in plan.trials] == [True, True]
    for t in plan.trials:
        total = t.settings["data.global_batch_size"]
        assert t.fitted["data.batch_size"] * t.fitted["training.gradient_accumulation"] == total
        # the trial's fit is the plan's own for its settings (what apply would fit)
        assert t.fitted == build_plan(cfg, vram="4GiB", overrides=t.settings).facts["fitted"]["keys"]
    assert plan.to_dict()["trials"][0]["fitted"] == plan.trials[0].fitted
    refused = plan_trial(cfg, {"data.global_batch_size": 8}, vram="1KiB")  # nothing fits: the trial's reason
    assert not refused.valid and "no layout of the global batch fits" in refused.reason()
