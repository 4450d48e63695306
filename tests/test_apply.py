"""apply decides the run's layout before it plans (apr/apply.py ``_layout``): the world size
torchrun started and, resuming a checkpoint of another world size, the gradient accumulation that
keeps its global batch, as settings the plan is built with; the run edits nothing."""

from __future__ import annotations

import shutil

from apr.apply import _layout
from tests.train.test_layout import _saved
from tests.train.tiny import make_config


def test_a_resume_on_another_world_size_is_planned_with_the_accumulation_that_keeps_the_batch(tmp_path):
    _saved(tmp_path, world=2, accum=2)
    config = make_config(training={"output_dir": str(tmp_path / "run")})
    settings, elastic = _layout(config, "latest", 4)
    assert settings == {"training.world_size": 4, "training.gradient_accumulation": 1}
    assert (elastic["from_world_size"], elastic["to_world_size"]) == (2, 4)
    settings, elastic = _layout(config, None, 4)  # a fresh run: only the world size
    assert settings == {"training.world_size": 4} and elastic is None
    assert _layout(config, None, 1) == ({}, None)  # one process, as configured


def test_a_config_the_plan_refuses_fails_before_torch_is_imported(tmp_path):
    """A fresh apply (no resume, no torchrun) plans before it loads the trainer: a config with an
    error costs the plan's second, not torch's import, and says what is wrong."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "configs/train/demo-tiny.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("num_attention_heads: 4 ", "num_attention_heads: 7 "))
    assert bad.read_text() != text
    probe = ("import json, sys\nfrom apr.cli.entry import run\nsys.argv = ['apr', 'train', 'apply', sys.argv[1]]\n"
             "code = 0\ntry:\n    run()\nexcept SystemExit as e:\n    code = e.code\n"
             "print(json.dumps([code, 'torch' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", probe, str(bad)], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "APR_HOME": str(tmp_path / "home")})
    code, torch_loaded = json.loads(out.stdout.splitlines()[-1])
    assert code == 1 and not torch_loaded, out.stdout + out.stderr
    assert "num_attention_heads" in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_a_busy_output_folder_is_refused_before_torch_is_imported(tmp_path):
    """A second apply on a folder another run holds is refused in the plan's time, naming the holder,
    without loading torch (let alone a model) in the process that is turned away."""
    import json
    import os
    import subprocess
    import sys

    from apr.train.outdir import OutputDirLock
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 8, "warmup_steps": 2})
    holder = OutputDirLock(tmp_path / "run")
    holder.acquire(cfg)  # this test process holds the folder, as a running apply would
    try:
        probe = ("import json, sys\nfrom apr.cli.entry import run\nsys.argv = ['apr', 'train', 'apply', sys.argv[1]]\n"
                 "code = 0\ntry:\n    run()\nexcept SystemExit as e:\n    code = e.code\n"
                 "print(json.dumps([code, 'torch' in sys.modules]))\n")
        out = subprocess.run([sys.executable, "-c", probe, str(cfg)], capture_output=True, text=True, cwd=tmp_path,
                             env={**os.environ, "APR_HOME": str(tmp_path / "home")})
    finally:
        holder.release()
    code, torch_loaded = json.loads(out.stdout.splitlines()[-1])
    assert code == 1 and not torch_loaded, out.stdout + out.stderr
    assert f"in use by another apr run (pid {os.getpid()}" in out.stderr and "Traceback" not in out.stderr


def test_a_saved_plan_runs_with_the_settings_it_was_planned_with(tmp_path):
    """`apr train plan CONFIG KEY=VALUE -out PLAN.json` then `apr train apply PLAN.json`: the run is the
    planned one (the settings were dropped before: the plan said one thing, the run did another)."""
    from apr.apply import run_apply
    from apr.plan.build import build_plan
    from apr.plan.planfile import save_plan
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 6, "eval_interval": 0, "save_interval": 1000})
    plan = build_plan(cfg, overrides={"training.max_steps": 3, "optimizer.lr": 0.002})
    save_plan(plan, tmp_path / "plan.json")
    result = run_apply(tmp_path / "plan.json", apr_home=tmp_path / "home", echo=lambda line: None,
                       handle_signals=False)
    assert (result.status, result.final_step, result.total_steps) == ("finished", 3, 3)
    import yaml

    ran = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert ran["optimizer"]["lr"] == 0.002 and ran["training"]["max_steps"] == 3


def test_auto_keys_run_as_the_plan_fitted_them_and_a_resume_never_fits_again(tmp_path, monkeypatch):
    """A config whose counts say auto: a fresh apply runs the plan's fitted values and says so; a saved
    plan and a resume run the values fitted before (the fit is not called again)."""
    import yaml

    from apr.apply import run_apply
    from apr.plan.build import build_plan
    from apr.plan.planfile import save_plan
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, data={"batch_size": "auto", "global_batch_size": 8},
                       training={"gradient_accumulation": "auto", "max_steps": 3, "warmup_steps": 0, "eval_interval": 0,
                                 "save_interval": 1})
    plan = build_plan(cfg)
    keys = plan.facts["fitted"]["keys"]
    assert keys["data.batch_size"] * keys["training.gradient_accumulation"] == 8
    save_plan(plan, tmp_path / "plan.json")

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted again")

    lines: list[str] = []
    result = run_apply(cfg, max_steps=2, apr_home=tmp_path / "home", echo=lines.append, handle_signals=False)
    assert result.final_step == 2 and any(line.startswith("data.batch_size auto -> ") for line in lines)
    ran = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert (ran["data"]["batch_size"], ran["training"]["gradient_accumulation"]) == tuple(keys.values())
    monkeypatch.setattr("apr.plan.build.fit_auto", no_fit)
    lines.clear()
    result = run_apply(cfg, resume="latest", max_steps=3, apr_home=tmp_path / "home", echo=lines.append,
                       handle_signals=False)
    assert (result.status, result.final_step) == ("finished", 3)
    assert f"data.batch_size auto -> {keys['data.batch_size']}: as the resumed checkpoint ran it (not fitted " \
           "again)" in lines
    shutil.rmtree(tmp_path / "run")
    result = run_apply(tmp_path / "plan.json", apr_home=tmp_path / "home", echo=lines.append, handle_signals=False)
    assert (result.status, result.final_step) == ("finished", 3)
    assert f"data.batch_size auto -> {keys['data.batch_size']}: as the saved plan fitted it" in lines
