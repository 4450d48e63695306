"""What ``apr train apply`` does before the loop: read a plan file or a config, refuse a stale plan,
run the plan's contracts and refuse on errors, apply the command-line overrides, then run.

A target ending in ``.json`` is a plan file saved by ``apr train plan -out``; anything else is a
config. Either way the plan is built again from the config as it is now, so the contracts that
``apply`` enforces are exactly the ones ``plan`` shows. This module sits above both ``apr.plan`` and
``apr.train``, which never import each other (docs/design.md, "Layers").
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from apr.config import load_config
from apr.config.auto import FITTED_KEYS
from apr.config.layers import parse_settings
from apr.errors import AprError, Finding
from apr.launch import env_nodes, env_world_size
from apr.plan.build import build_plan, normalise_overrides
from apr.plan.elastic import elastic_layout
from apr.plan.fit import auto_line, fitted_settings, resumed_settings
from apr.plan.planfile import check_plan_fresh, load_plan_file
from apr.steps.resolved import laid_out
from apr.train.outdir import OutputDirLock


def _plan_errors_error(plan, config_path: Path) -> AprError:
    errors = [f for f in plan.findings if f.severity == "error"]
    return AprError(
        f"the plan for {config_path} has {len(errors)} error(s); fix them (see `apr train plan {config_path}`)",
        errors)


def _device_budget(config):
    from apr.train.devicemem import device_budget  # imports torch: only once the config is valid

    return device_budget(config)


def command_line_overrides(settings: list[str] | None, from_plan_file: bool, **named) -> dict:
    """apply's named options (``seed``...) and ``KEY=VALUE`` settings as one overrides mapping. A saved
    plan fixed its settings when it was made, and a key given both ways is ambiguous: both refused."""

    overrides = {k: v for k, v in named.items() if v is not None}
    if not settings:
        return overrides
    if from_plan_file:
        raise AprError("a saved plan already fixes the config: give KEY=VALUE settings to `apr train plan`",
                       [Finding("error", "apply.usage", "KEY=VALUE settings with a plan file", file="command line",
                                expected="a config file, or a plan made with these settings",
                                got=" ".join(settings)[:200])])
    parsed = parse_settings(settings)
    for key in overrides:
        if f"training.{key}" in parsed:
            raise AprError(f"training.{key} is given twice: as --{key.replace('_', '-')} and as a setting",
                           [Finding("error", "apply.usage", "the same key set twice", path=f"training.{key}",
                                    file="command line", expected="one of the two", got="both")])
    return {**parsed, **overrides}


def _layout(config, resume: str | None, world: int) -> tuple[dict, dict | None]:
    """The layout the run will execute, as settings the plan is built with: the world size torchrun
    started and, resuming a checkpoint of another world size, the gradient accumulation that keeps
    its global batch (apr/train/layout.py). The plan then sizes what runs; the run edits nothing."""
    settings: dict = {}
    if world > 1 and config.training.world_size != world:
        settings["training.world_size"] = world
    run_dir = Path(os.path.abspath(os.path.expanduser(config.training.output_dir)))
    elastic = elastic_layout(laid_out(config, max(world, 1)), run_dir, resume, max(world, 1))
    if elastic is not None:
        settings["training.gradient_accumulation"] = elastic["to_accumulation"]
    return settings, elastic


def run_apply(target: Path, *, seed: int | None = None, device: str | None = None, max_steps: int | None = None,
              resume: str | None = None, force: bool = False, gpu: str | None = None, vram: str | None = None,
              allow_other_run: bool = False,
              apr_home: Path | None = None, echo=None, progress=None, handle_signals: bool = True,
              settings: list[str] | None = None, fork_of: dict | None = None):
    """Plan and run; returns ``apr.train.run.RunResult``. Raises AprError for anything a user can fix."""
    if force and resume is None:
        raise AprError("--force only applies to a resume (--resume latest|PATH)", [Finding(
            "error", "apply.usage", "--force without --resume", expected="--resume with --force", got="--force")])
    target = Path(target)
    plan_doc = None
    if target.suffix == ".json":
        plan_doc = load_plan_file(target)
        config_path = check_plan_fresh(plan_doc)
        if gpu is None and vram is None:
            tgt = plan_doc.get("target") or {}
            gpu, vram = tgt.get("gpu"), tgt.get("vram")
    else:
        config_path = target
    overrides = command_line_overrides(settings, plan_doc is not None, seed=seed, device=device,
                                       max_steps=max_steps)
    if plan_doc is not None:  # the plan's own KEY=VALUE settings: what was planned is what runs
        overrides = {**(plan_doc.get("overrides") or {}), **overrides}
    # the values a saved plan fitted for the config's auto keys, or those a resumed checkpoint ran
    fitted = fitted_settings(plan_doc) if plan_doc is not None else {}
    # read and check the config before importing torch: a bad one fails at once
    loaded = load_config(config_path, normalise_overrides({**overrides, **fitted}) or None)
    if loaded.auto and resume is not None:
        run_dir = Path(os.path.abspath(os.path.expanduser(loaded.config.training.output_dir)))
        fitted = {**fitted, **resumed_settings(run_dir, resume, loaded.auto, loaded.config.training.world_size)}
        loaded = load_config(config_path, normalise_overrides({**overrides, **fitted}) or None)
    world = env_world_size()  # under torchrun: the step algebra divides by the real number of ranks
    # the layout reads checkpoints with the trainer's modules (torch): only for a resume or torchrun,
    # so that a config the plan refuses fails before torch is imported
    layout_settings, elastic = _layout(loaded.config, resume, world) if resume is not None or world > 1 else ({}, None)
    plan = build_plan(config_path, gpu=gpu, vram=vram, world_size=world if world > 1 else None,
                      nodes=env_nodes(world) if world > 1 else None,
                      overrides={**overrides, **fitted, **layout_settings} or None, device_budget=_device_budget)
    if plan.errors:
        raise _plan_errors_error(plan, config_path)
    lock = _lock_output(plan.config, config_path)  # a busy folder is refused before torch is imported
    try:
        return _prepare_and_run(plan, plan_doc, config_path, lock, overrides=overrides, resume=resume, force=force,
                                apr_home=apr_home, echo=echo, progress=progress, handle_signals=handle_signals,
                                allow_other_run=allow_other_run, elastic=elastic, fork_of=fork_of,
                                fitted=fitted_lines(plan, fitted, plan_doc is not None))
    finally:
        if lock is not None:
            lock.release()  # (the run released it already when it ran)


def fitted_lines(plan, fitted: dict, from_plan_file: bool) -> list[str]:
    """What apply says of the config's auto keys: fitted now, as the saved plan fitted them, or as the
    resumed checkpoint ran them (never fitted again)."""
    where = "as the saved plan fitted it" if from_plan_file else "as the resumed checkpoint ran it (not fitted again)"
    lines = [f"{key} auto -> {value}: {where}" for key, value in fitted.items() if key in FITTED_KEYS]
    record = plan.facts.get("fitted")
    return [*lines, auto_line(record)] if record else lines


def _lock_output(config, config_path: Path):
    """Rank 0 takes the output folder's lock (apr/train/outdir.py: torch-free); other ranks take none."""
    if os.environ.get("RANK", "0") != "0":
        return None
    lock = OutputDirLock(Path(os.path.abspath(os.path.expanduser(config.training.output_dir))))
    lock.acquire(config_path)
    return lock


def _prepare_and_run(plan, plan_doc, config_path: Path, lock, *, overrides, resume, force, apr_home, echo, progress,
                     handle_signals, allow_other_run, elastic, fork_of=None, fitted=()):
    from apr.train.run import ApplyOptions, prepare_run  # imports torch: only once the plan is sound
    if plan_doc is None:
        plan_doc = plan.to_dict()

    if not plan.config.monitoring.terminal.enabled:  # monitoring.terminal.enabled: false draws no bar
        progress = None
    options = ApplyOptions(resume=resume, force=force, apr_home=apr_home, handle_signals=handle_signals,
                           progress=progress, overrides=overrides, allow_other_run=allow_other_run, lock=lock,
                           fork_of=fork_of)
    if echo is not None:
        options.echo = echo
    is_main = os.environ.get("RANK", "0") == "0"
    for w in plan.warnings if is_main else []:
        options.echo(f"plan warning [{w.code}] {w.path + ': ' if w.path else ''}{w.message}")
    decided = plan.execution.get("compile") or {}
    if is_main and decided.get("setting") == "auto":  # what the plan decided for this run, and why
        options.echo(f"training.execution.compile auto -> {'compiled' if decided['compile'] else 'eager'} "
                     f"blocks: {decided['reason']}")
    for line in fitted if is_main else []:
        options.echo(line)
    for skipped in (plan.facts.get("calibration_skipped") or []) if is_main else []:
        options.echo(f"warning: calibration row skipped: {skipped}")
    run = prepare_run(replace(plan.resolved, elastic=elastic), config_hash=plan.config_hash,
                      config_path=config_path, options=options, plan_doc=plan_doc)
    return run.execute()
