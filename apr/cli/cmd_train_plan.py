"""`apr train plan CONFIG`: prove, without a GPU, that a run is coherent and fits. Parse, call, render."""

from __future__ import annotations

import math
import os
import sqlite3
import sys
from pathlib import Path

import typer

from apr.cli.cmd_train_validate import output_format
from apr.cli.ghactions import emit, summary_markdown
from apr.cli.render import print_error, use_colour
from apr.errors import AprError, Finding
from apr.fsutil import check_output_file
from apr.plan.render import github_facts, render_error_json, render_json, render_text
from apr.trace import trace_plan


def parse_price(text: str) -> float:
    """``--price``: a positive, finite number (per GPU-hour); anything else is an AprError (exit 1)."""
    try:
        value = float(text.strip().lstrip("$"))
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        message = f"--price must be a positive number (the price of one GPU for one hour), got {text!r}"
        raise AprError(message, [Finding("error", "plan.bad_price", message, path="--price",
                                         expected="a positive number, e.g. 2.49", got=repr(text))])
    return value


def run_plan(config: Path, *, gpu: str | None, vram: str | None, world_size: int | None, json_out: bool,
             nodes: int | None = None,
             strict: bool, out: Path | None, verbose: bool = False, overwrite: bool = False,
             fmt: str | None = None, settings: list[str] | None = None, explain: str | None = None,
             price: str | None = None, probe: bool = False, probe_steps: int = 3,
             trace: bool = False, trace_timeout: float = 600.0, fit: bool = False) -> int:
    """Build, render and optionally save the plan; return the exit code (0 ok, 1 errors)."""
    from apr.plan.build import PlanUsageError, build_plan

    try:
        if price is not None:  # the same as the setting training.price_per_gpu_hour=PRICE
            settings = [*(settings or []), f"training.price_per_gpu_hour={parse_price(price)!r}"]
        if out is not None:
            check_output_file(out, inputs=[config], overwrite=overwrite, option="-out")
            if fit and out.suffix.lower() not in (".yaml", ".yml"):
                raise typer.BadParameter(f"with --fit, -out writes the fitted config: a .yaml file, got {out}",
                                         param_hint="'-out'")
        from apr.config.layers import parse_settings

        overrides = parse_settings(settings) if settings else None
        if explain is not None:
            from apr.config import load_config
            from apr.plan.explain import explain_lines

            sys.stdout.write(explain_lines(load_config(config, overrides), explain))
            return 0
        plan = build_plan(config, gpu=gpu, vram=vram, world_size=world_size, nodes=nodes, overrides=overrides)
        if probe:  # synthetic ids: the probe runs even where the data is missing (the plan still fails)
            plan = probe_plan(plan, probe_steps, lambda: build_plan(config, gpu=gpu, vram=vram, world_size=world_size,
                                                                    nodes=nodes, overrides=overrides))
        fitted = None
        if fit:  # the layout that trains fastest within the budget, then the plan of that layout
            from apr.plan.fit import fit_plan

            fitted = fit_plan(plan)
            if fitted.changed and not fitted.planned_as_is(plan):
                plan = build_plan(config, gpu=gpu, vram=vram, world_size=world_size, nodes=nodes,
                                  overrides={**(overrides or {}), **fitted.changed})
    except PlanUsageError as err:
        hint = {"plan.unknown_gpu": "'--gpu'", "plan.bad_vram": "'--vram'"}.get(
            err.findings[0].code if err.findings else "", "'--world-size'")
        raise typer.BadParameter(err.findings[0].message if err.findings else err.message, param_hint=hint) from None
    except AprError as err:
        if json_out:
            sys.stdout.write(render_error_json(config, err))
        elif fmt == "github":

            findings = err.findings or [Finding("error", "plan.error", err.message, file=str(config))]
            emit(findings, summary_markdown(f"apr train plan {config}", "errors", findings, str(config)),
                 str(config), sys.stdout)
        else:
            print_error(err)
        return err.exit_code
    code = plan.exit_code(strict)
    traced = None
    if trace and plan.errors:
        print("--trace: not traced, the plan has errors (see its findings)", file=sys.stderr)
    elif trace:
        try:
            traced = trace_plan(plan, timeout_s=trace_timeout)
        except AprError as err:
            if json_out:
                sys.stdout.write(render_error_json(config, err))
            else:
                print_error(err)
            return err.exit_code
    if json_out:
        sys.stdout.write(render_json(plan, trace=traced, fit=fitted))
    elif fmt == "github":

        verdict = ("ok" if code == 0 else "errors" if plan.errors else "warnings (--strict)") + (
            f" ({len(plan.errors)} errors, {len(plan.warnings)} warnings)")
        emit(plan.findings, summary_markdown(f"apr train plan {config}", verdict, plan.findings, str(config),
                                             github_facts(plan)), str(config), sys.stdout)
    else:

        sys.stdout.write(render_text(plan, colour=use_colour(sys.stdout), verbose=verbose, trace=traced, fit=fitted))
    if out is not None:
        if code != 0:
            why = "errors" if plan.errors else "warnings (--strict)"
            print(f"{'fitted config' if fit else 'plan'} not saved to {out}: it has {why}", file=sys.stderr)
        elif fitted is not None:
            from apr.plan.fit import write_fitted

            try:
                write_fitted(fitted, out, settings=overrides, overwrite=overwrite)
            except AprError as err:
                print_error(err)
                return err.exit_code
            print(f"Saved the fitted config to {out}; plan it with: apr train plan {out}",
                  file=sys.stderr if json_out else sys.stdout)
        else:
            from apr.plan.planfile import save_plan

            try:
                save_plan(plan, out)
            except AprError as err:
                print_error(err)
                return err.exit_code
            print(f"Saved the plan to {out}; run it with: apr train apply {out}",
                  file=sys.stderr if json_out else sys.stdout)
    return code


def probe_plan(plan, steps: int, rebuild):
    """Run the probe (apr/probe.py), keep it in the calibration store, and plan again so the
    printed plan uses it; the probe's measurements go into the plan's facts."""
    from apr.probe import one_process_rows, run_probe
    from apr.track import calibration
    from apr.track.names import global_db_path

    policy = plan.execution["policy"]
    print(f"probing {plan.config.training.device} with the real engine ({steps} timed steps)...", file=sys.stderr)
    result = run_probe(plan.config, policy, one_process_rows(plan.config, policy), steps=steps,
                       world_size=plan.world_size)
    result["planned_world_size"] = plan.world_size
    threads = result["threads"] if result["device"] == "cpu" else None  # a CPU's speed depends on them
    try:
        result["calibration_id"] = calibration.record(result, calibration.shape(plan.config, policy, threads))
    except (sqlite3.Error, OSError, AprError) as err:  # a damaged or foreign calibrations table, a full disk
        reason = err.message if isinstance(err, AprError) else f"{type(err).__name__}: {str(err)[:200]}"
        print(f"warning: the probe's result could not be kept in the calibration store "
              f"{global_db_path()} ({reason}); this plan shows the probe, later plans cannot use it "
              "(move the damaged store aside to start a new one)", file=sys.stderr)
        result["calibration_id"] = None
    plan = rebuild()
    plan.facts["probe"] = result
    return plan


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan(
        config: Path = typer.Argument(..., help="Training config (YAML).", show_default=False),
        settings: list[str] | None = typer.Argument(
            None, metavar="KEY=VALUE", show_default=False,
            help="Override config keys (training.max_steps=100), as `apr train apply` would."),
        explain: str | None = typer.Option(
            None, "--explain", metavar="KEY",
            help="Print KEY's effective value (a dotted key or section) and where each value came from."),
        gpu: str | None = typer.Option(
            None, "--gpu", metavar="NAME",
            help="Target GPU from the catalogue (4090, 3090, a10, l4, t4, v100, a6000, l40s, a100-40gb, "
                 "a100-80gb, h100, h100-pcie, h200) for the memory check and time estimate."),
        vram: str | None = typer.Option(
            None, "--vram", metavar="SIZE", help="Target GPU memory, e.g. 24GiB (overrides --gpu's memory)."),
        world_size: int | None = typer.Option(
            None, "--world-size", min=1, metavar="N", help="Data-parallel GPUs (default: training.world_size)."),
        nodes: int | None = typer.Option(
            None, "--nodes", min=1, metavar="N",
            help="Hosts the GPUs are spread over, for hybrid sharding's per-rank memory (default: training.nodes)."),
        json_out: bool = typer.Option(False, "--json", help="Print the plan as one JSON object (= --format json)."),
        fmt: str | None = typer.Option(
            None, "--format", metavar="FORMAT",
            help="text (default), json, or github: GitHub Actions annotations and a step summary."),
        strict: bool = typer.Option(False, "--strict", help="Fail (exit 1) on warnings too."),
        out: Path | None = typer.Option(
            None, "-out", "--out", metavar="PLAN.json",
            help="Save the plan (with the config hash and data fingerprint) for `apr train apply PLAN.json`."),
        price: str | None = typer.Option(
            None, "--price", metavar="PRICE",
            help="Price of one GPU for one hour (= training.price_per_gpu_hour=PRICE): total cost and cost "
                 "per billion tokens."),
        probe: bool = typer.Option(
            False, "--probe", help="Build the real engine on training.device, run a few steps on synthetic token "
            "ids and show measured memory and speed beside the model; kept as a calibration for later plans."),
        trace: bool = typer.Option(
            False, "--trace", help="Run one rank of the engine apply would build on fake tensors (no memory, no GPU) "
            "for two steps and show the bytes it holds beside each memory row of the plan."),
        trace_timeout: float = typer.Option(
            600.0, "--trace-timeout", min=1.0, metavar="SECONDS", help="Stop --trace after this long and say what "
            "it reached (exit 1)."),
        probe_steps: int = typer.Option(3, "--probe-steps", min=1, max=100, metavar="N",
                                        help="Timed steps of --probe (after one warm-up and one memory step)."),
        cpu_threads: int | None = typer.Option(
            None, "--cpu-threads", min=1, metavar="N",
            help="torch intra-op threads per process for the probe and the estimate (= APR_CPU_THREADS=N; "
                 "default: training.cpu_threads, else the usable cores / ranks per node)."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="List skipped contracts and why."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing -out file."),
        fit: bool = typer.Option(
            False, "--fit", help="Search micro-batch x accumulation x activation policy x sharding x compile, keeping "
            "the global batch, for the fastest layout within the memory budget; plan it (-out FITTED.yaml: a config "
            "extending this one with the changed keys)."),
    ) -> None:
        """Check a run without a GPU: step algebra, architecture, data, tokenizer, memory and time.
        Exit 0 no errors, 1 errors (or warnings with --strict), 2 usage."""

        fmt = output_format(fmt, json_out)
        if cpu_threads is not None:  # the same override apply reads (apr/threads.py)
            os.environ["APR_CPU_THREADS"] = str(cpu_threads)
        raise typer.Exit(run_plan(config, gpu=gpu, vram=vram, world_size=world_size, nodes=nodes,
                                  json_out=fmt == "json",
                                  strict=strict, out=out, verbose=verbose,
                                  overwrite=overwrite, fmt=fmt, settings=settings, explain=explain,
                                  price=price, probe=probe, probe_steps=probe_steps, trace=trace,
                                  trace_timeout=trace_timeout, fit=fit))
