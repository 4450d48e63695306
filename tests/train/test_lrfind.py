"""apr train lr-find: the LR range test sweeps on a throwaway copy, suggests an LR by a named rule,
writes its SVG/JSON and a copy of the config, and refuses a bad range before any work."""

from __future__ import annotations

import json
import math

import pytest
from run_helpers import make_dataset, write_config
from typer.testing import CliRunner

from apr.cli.main import app
from apr.lrfind import Curve, RangeTest, range_findings


def test_the_sweep_is_exponential_from_min_to_max():
    test = RangeTest(min_lr=1e-5, max_lr=1e-1, steps=5)
    assert [round(math.log10(test.lr(s)), 9) for s in range(1, 6)] == [-5, -4, -3, -2, -1]


def test_the_rules_find_the_steepest_fall_and_the_minimum():
    # a loss flat at 5, falling fastest around lr 1e-3, bottoming out at 1e-2, then rising
    curve = Curve()
    lrs = [10 ** (-6 + i * 0.1) for i in range(51)]  # 1e-6 .. 1e-1
    for lr in lrs:
        x = math.log10(lr)
        loss = 3 + 2 / (1 + math.exp(3 * (x + 3))) if x <= -2 else 3 + 2 / (1 + math.exp(3)) + (x + 2) ** 2
        curve.add(lr, loss, beta=0.0)  # no smoothing: the rules see the exact curve
    assert abs(math.log10(curve.suggest("steepest")) - -3) <= 0.1
    assert abs(math.log10(curve.suggest("min10")) - -3) <= 0.1  # minimum at 1e-2, / 10


def test_bad_ranges_are_findings_naming_the_option():
    codes = {f.path for f in range_findings(RangeTest(min_lr=1e-2, max_lr=1e-3))}
    assert codes == {"--min-lr"}
    assert {f.path for f in range_findings(RangeTest(min_lr=0, max_lr=1, steps=3, rule="x"))} == {
        "--min-lr", "--steps", "--rule"}


@pytest.mark.slow
def test_lr_find_cli_on_tiny_data_writes_plot_json_beside_the_run_and_a_config_copy(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 12})
    home = tmp_path / "home"
    monkeypatch.setenv("APR_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "lr-find", str(cfg), "--min-lr", "1e-5", "--max-lr", "3",
                                      "--steps", "30", "--apply"])
    assert result.exit_code == 0, result.output
    assert "suggested lr " in result.output and "rule steepest" in result.output
    # the run's folder gets the plot and the curve, nothing else; the global store and the current
    # folder are untouched (the data loader's token cache may fill)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["lr-find.json", "lr-find.svg"]
    assert not (home / "experiments.db").exists() and not (tmp_path / "lr-find.json").exists()
    doc = json.loads((tmp_path / "run" / "lr-find.json").read_text())
    assert doc["rule"] == "steepest" and 1e-5 <= doc["suggested_lr"] <= 3
    points = doc["points"]
    assert points[0]["lr"] == 1e-5 and 3 <= len(points) <= 30
    assert all(b["lr"] > a["lr"] for a, b in zip(points, points[1:], strict=False))
    svg = (tmp_path / "run" / "lr-find.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<path") == 2
    copy = (tmp_path / "cfg.lr-find.yaml").read_text()
    rounded = float(f"{doc['suggested_lr']:.3g}")
    assert f"lr: {rounded}" in copy
    assert "lr: 0.01" in cfg.read_text()  # the original is unchanged


def test_lr_find_refuses_an_empty_range_with_exit_1_before_training(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "lr-find", str(cfg), "--min-lr", "1", "--max-lr", "0.1"])
    assert result.exit_code == 1
    assert "--min-lr" in result.output and "min 1 >= max 0.1" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "lr-find.json").exists()


def test_the_sweep_turns_off_what_would_fight_a_rising_loss(tmp_path):
    from apr.lrfind import RangeTest, sweep_config
    from tests.train.tiny import make_config

    config = make_config(training={"early_stopping": {"patience": 2}, "bad_steps": {"loss_z": 3.0},
                                   "rollback": {"threshold": 1.5}})
    swept = sweep_config(config, RangeTest(steps=20), tmp_path / "out").training
    assert swept.early_stopping.patience is None and swept.rollback.threshold is None
    assert swept.bad_steps.loss_z is None and swept.bad_steps.grad_norm_z is None
    assert swept.max_steps == 20 and swept.output_dir == str(tmp_path / "out")


def test_outputs_default_to_the_runs_folder_and_are_checked_before_the_sweep(tmp_path, monkeypatch):
    from apr.errors import AprError
    from apr.lrfind import output_targets

    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    targets = output_targets(cfg, None, plot=None, json_out=None, apply_to=None, overwrite=False, apply=True)
    out_dir = tmp_path / "run"
    assert (targets.plot, targets.json_out) == (out_dir / "lr-find.svg", out_dir / "lr-find.json")
    assert targets.apply_to == cfg.with_name("cfg.lr-find.yaml")
    # an earlier sweep's files at the default paths are replaced; anything else needs --overwrite
    assert out_dir.is_dir()  # made (and probed for writing) before the sweep
    (out_dir / "lr-find.json").write_text('{"format": "apr-lr-find", "points": []}')
    (out_dir / "lr-find.svg").write_text("<svg><text>LR range test</text></svg>")
    output_targets(cfg, None, plot=None, json_out=None, apply_to=None, overwrite=False)
    (out_dir / "lr-find.json").write_text("my notes")
    with pytest.raises(AprError, match="--json-out .* already exists"):
        output_targets(cfg, None, plot=None, json_out=None, apply_to=None, overwrite=False)
    with pytest.raises(AprError, match="--plot .* is an input"):
        output_targets(cfg, None, plot=cfg, json_out=tmp_path / "c.json", apply_to=None, overwrite=True)
    with pytest.raises(AprError, match="is also --plot"):
        output_targets(cfg, None, plot=tmp_path / "x", json_out=tmp_path / "x", apply_to=None, overwrite=False)
    # a settings override of the output folder moves the defaults with it
    moved = output_targets(cfg, ["training.output_dir=elsewhere"], plot=None, json_out=None, apply_to=None,
                           overwrite=False)
    assert moved.plot.resolve() == tmp_path / "elsewhere" / "lr-find.svg"


def test_no_output_may_be_a_file_the_config_extends(tmp_path, monkeypatch):
    from apr.errors import AprError
    from apr.lrfind import output_targets

    make_dataset(tmp_path)
    base = write_config(tmp_path, name="base.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\noptimizer:\n  lr: 0.02\n")
    monkeypatch.chdir(tmp_path)
    before = base.read_bytes()
    for option in ("plot", "json_out", "apply_to"):
        kw = {"plot": tmp_path / "p.svg", "json_out": tmp_path / "c.json", "apply_to": None, option: base}
        with pytest.raises(AprError, match="is an input"):
            output_targets(child, None, overwrite=True, apply=True, **kw)
    assert base.read_bytes() == before
