"""apply runs exactly the execution policy its plan chose."""

from __future__ import annotations

from run_helpers import make_dataset, write_config

from apr.apply import run_apply
from apr.plan.build import build_plan, resolve_config
from apr.train import build as engine_module


def _capture(monkeypatch) -> list:
    built = []
    real = engine_module.build_engine

    def spy(*args, **kwargs):
        e = real(*args, **kwargs)
        built.append(e)
        return e

    monkeypatch.setattr(engine_module, "build_engine", spy)
    return built


def test_apply_runs_the_policy_the_plan_chose_for_the_budget(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000})
    roomy = build_plan(cfg)
    alts = {(a["activations"], a["gradients"]): a for a in roomy.execution["alternatives"]}
    assert roomy.execution["policy"]["activations"] == "keep" and roomy.execution["policy"]["gradients"] == "kept"
    lean = alts[("recompute", "workspace")]
    assert lean["total_bytes"] == min(a["total_bytes"] for a in alts.values())
    vram = f"{lean['total_bytes'] + 1}B"  # only the leanest policy fits (under 1 MiB on the CPU: a unit)
    plan = build_plan(cfg, vram=vram)
    assert plan.execution["policy"]["activations"] == "recompute"
    assert plan.execution["policy"]["gradients"] == "workspace" and not plan.errors
    built = _capture(monkeypatch)
    result = run_apply(cfg, vram=vram, apr_home=tmp_path / "home", echo=lambda line: None)
    assert result.status == "finished"
    (engine,) = built
    assert engine.execution.activations == "recompute" and engine.execution.gradients == "workspace"
    assert engine.gradients.workspace is not None and engine.gradients.block_groups[0].own_grad is None


def test_apply_without_a_target_decides_from_the_devices_memory(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000})
    monkeypatch.setattr("apr.train.devicemem._meminfo_available", lambda: 600 * 2**20)
    built = _capture(monkeypatch)
    run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
    plan = build_plan(cfg, vram=600 * 2**20)
    (engine,) = built
    assert engine.execution.to_dict() == plan.execution["policy"]


def test_an_adagc_run_resumes_from_its_checkpoint_bitwise(tmp_path):
    import json
    import shutil

    from run_helpers import config_doc
    from safetensors.torch import load_file

    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.run import ApplyOptions, prepare_run

    make_dataset(tmp_path)
    sections = {"training": {"clip_mode": "adagc", "grad_clip": 0.5, "adagc": {"warmup_steps": 2},
                             "max_steps": 6, "save_interval": 3, "keep_last": 2, "eval_interval": 0}}

    def run(resume=None, **over):
        doc = config_doc(tmp_path, **sections)
        doc["training"].update(over)
        cfg = AprConfig.model_validate(doc)
        opts = ApplyOptions(echo=lambda line: None, resume=resume)
        return prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                           options=opts).execute()

    assert run().final_step == 6
    meta = json.loads((tmp_path / "run" / "checkpoint-step-3.json").read_text())
    assert "adagc_ema" in json.dumps(meta)
    other = tmp_path / "other"
    other.mkdir()
    for suffix in ("json", "safetensors"):
        shutil.copy(tmp_path / "run" / f"checkpoint-step-3.{suffix}", other / f"checkpoint-step-3.{suffix}")
    assert run(resume="latest", output_dir=str(other)).final_step == 6
    a = load_file(str(tmp_path / "run" / "checkpoint-step-6.safetensors"))
    b = load_file(str(other / "checkpoint-step-6.safetensors"))
    assert all(a[k].equal(b[k]) for k in a)


def test_apply_compiles_the_blocks_when_the_plan_decides_compile_auto_pays(tmp_path, monkeypatch):
    from apr import __version__
    from apr.config import load_config
    from apr.plan.facts import cpu_threads
    from apr.steps import execution
    from apr.track import calibration

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000,
                                           "execution": {"activations": "keep", "gradients": "kept",
                                                         "compile": "auto"}})
    config = load_config(cfg).config
    eager = {"activations": "keep", "gradients": "kept", "compile": False, "kept_blocks": 2,
             "recomputed_blocks": 0, "recompute": "none"}
    probe = {"source": "probe", "device": "cpu", "device_name": calibration.host_cpu_name(), "rows": [],
             "versions": {"torch": calibration.torch_version(), "cuda": None, "apr": __version__, "python": "3"},
             "tokens_per_s": 100.0, "step_seconds": 3.0, "step_seconds_all": [3.0], "startup_seconds": 1.0,
             "load": 0.5, "threads": 1}
    calibration.record(probe, calibration.shape(config, eager, cpu_threads(config, 1)["threads"]))
    # a compiler this fast repays itself in 3 steps of 3 s (the real one is timed by bench_compile.py)
    monkeypatch.setattr(execution, "COMPILE_COST_S", {"cpu": {"cold": 0.1, "warm": 0.1}})
    monkeypatch.setattr(execution, "compile_problem", lambda device: None)
    compiled = []
    monkeypatch.setattr(engine_module, "compile_blocks", lambda model, *a, **kw: compiled.append(model))
    built, lines = _capture(monkeypatch), []
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lines.append)
    assert result.status == "finished"
    (engine,) = built
    assert engine.execution.compile is True and compiled == [engine.model]
    assert any(line.startswith("training.execution.compile auto -> compiled blocks: 3 steps x 3 s") for line in lines)
