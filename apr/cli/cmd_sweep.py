"""`apr sweep run|plan|status|best SWEEP.yaml`: hyperparameter sweeps over a base config, planned
before they spend (docs/sweeps.md). Parse, call apr.sweep, render."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from apr.cli.render import print_findings
from apr.cli.table import text_table
from apr.fmt import fmt_duration, fmt_setting, safe_text
from apr.fsutil import check_output_folder

CONFIG_HELP = "Base config (overrides the sweep file's `config:` key)."
DIR_HELP = "The sweep's folder: storage, trials' runs, reports (default: output_dir of the file, else sweeps/NAME)."
STORAGE_HELP = ("Optuna RDB URL shared by every worker (default: sqlite:///FOLDER/study.db); e.g. "
                "postgresql://user@host/db for workers on several machines.")


def _check_folder(folder: Path | None, sweep: Path, config: Path | None) -> None:
    """``--dir`` is a folder apr writes (storage, trials' runs, reports): refused before anything is
    read when it is a file, a FIFO, a device, a symlink, apr's own records or an input."""
    if folder is not None:
        check_output_folder(folder, inputs=[sweep, *([config] if config else [])], option="--dir")


def _load(sweep: Path, config: Path | None):
    from apr.sweep.spec import load_sweep

    spec = load_sweep(sweep, config)
    print_findings(spec.warnings)
    return spec


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        sweep: Path = typer.Argument(..., show_default=False, help="The sweep file (W&B sweep format)."),
        config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
        count: int | None = typer.Option(None, "--count", min=1, help="Trials in all (overrides run_cap)."),
        workers: int = typer.Option(1, "--workers", min=1, max=64, help="Worker processes on this machine."),
        storage: str | None = typer.Option(None, "--storage", metavar="URL", help=STORAGE_HELP),
        folder: Path | None = typer.Option(None, "--dir", help=DIR_HELP),
        nproc: int = typer.Option(1, "--nproc-per-trial", min=1, help="Run each trial under torchrun with K ranks."),
        gpu: str | None = typer.Option(None, "--gpu", help="Target GPU for each trial's plan."),
        vram: str | None = typer.Option(None, "--vram", help="Target VRAM for each trial's plan."),
        heartbeat: int = typer.Option(60, "--heartbeat", min=0, metavar="S",
                                      help="Seconds between a running trial's heartbeats in the storage (0: off)."),
        grace: int = typer.Option(300, "--grace", min=1, metavar="S",
                                  help="A trial whose heartbeat is older is failed and retried by another worker, "
                                       "from its last checkpoint where its folder is shared."),
        worker_id: int | None = typer.Option(None, "--worker-id", hidden=True),
    ) -> None:
        """Run (or continue) a sweep: plan each trial, train the valid ones with `apr train apply`, record
        the results in the sweep's Optuna storage. Run it again after a stop to continue. Exit 0 done,
        1 bad input, 130/143 stopped (the interrupted trial resumes on the next run)."""
        from apr.sweep.planning import sweep_dir
        from apr.sweep.runner import run_helper, run_sweep

        _check_folder(folder, sweep, config)
        spec = _load(sweep, config)
        where = sweep_dir(spec, folder)
        common = dict(storage=storage, count=count, nproc=nproc, gpu=gpu, vram=vram, heartbeat=heartbeat, grace=grace)
        if worker_id is not None:  # a helper started by `--workers N`
            report = run_helper(spec, where, worker=worker_id, echo=_echo, **common)
            raise typer.Exit(report.exit_code)

        def helper(i: int) -> list[str]:
            args = [sys.executable, "-m", "apr", "sweep", "run", str(sweep), "--dir", str(where), "--worker-id", str(i),
                    "--nproc-per-trial", str(nproc), "--heartbeat", str(heartbeat), "--grace", str(grace)]
            for flag, value in (("--config", config), ("--count", count), ("--storage", storage), ("--gpu", gpu),
                                ("--vram", vram)):
                args += [flag, str(value)] if value is not None else []
            return args

        result = run_sweep(spec, where, workers=workers, helper_command=helper, echo=_echo, given=folder, **common)
        _finish(spec, result)
        raise typer.Exit(result.exit_code)

    @app.command("plan")
    def plan(
        sweep: Path = typer.Argument(..., show_default=False, help="The sweep file (W&B sweep format)."),
        config: Path | None = typer.Option(None, "--config", help=CONFIG_HELP),
        sample: int | None = typer.Option(None, "--sample", min=1, max=10_000,
                                          help="Plan N trials drawn by the sweep's sampler (default: a grid's every "
                                               "point, else 20)."),
        count: int | None = typer.Option(None, "--count", min=1, help="Trials in all (overrides run_cap)."),
        gpu: str | None = typer.Option(None, "--gpu", help="Target GPU: memory check, time and cost per trial."),
        vram: str | None = typer.Option(None, "--vram", help="Target VRAM for the memory check."),
        price: float | None = typer.Option(None, "--price", min=0.0, help="Price of one GPU-hour (cost per trial)."),
        json_out: bool = typer.Option(False, "--json", help="One JSON object."),
    ) -> None:
        """Plan a sweep without training: how many trials are valid, why the others are not, and the
        tokens, time and cost of the valid ones and of the whole sweep. Exit 0 (1 on bad input)."""
        from apr.sweep.planning import plan_sweep

        spec = _load(sweep, config)
        settings = {"training.price_per_gpu_hour": price} if price is not None else None
        result = plan_sweep(spec, sample=sample, count=count, gpu=gpu, vram=vram, settings=settings)
        if json_out:
            print(json.dumps(result.to_dict(), indent=1, default=str))
        else:
            print(_plan_text(result))

    @app.command("status")
    def status(
        sweep: Path = typer.Argument(..., show_default=False, help="The sweep file."),
        storage: str | None = typer.Option(None, "--storage", metavar="URL", help=STORAGE_HELP),
        folder: Path | None = typer.Option(None, "--dir", help=DIR_HELP),
        json_out: bool = typer.Option(False, "--json", help="One JSON object."),
    ) -> None:
        """Every trial: state (finished, pruned, invalid, failed, running, interrupted), metric, parameters
        and the reason of a pruned or failed one."""
        doc = _status(sweep, storage, folder)
        if json_out:
            print(json.dumps(doc, indent=1, default=str))
            return
        print(_status_text(doc))

    @app.command("best")
    def best(
        sweep: Path = typer.Argument(..., show_default=False, help="The sweep file."),
        storage: str | None = typer.Option(None, "--storage", metavar="URL", help=STORAGE_HELP),
        folder: Path | None = typer.Option(None, "--dir", help=DIR_HELP),
        json_out: bool = typer.Option(False, "--json", help="One JSON object."),
    ) -> None:
        """The best finished trial: its metric, parameters, run and a config that trains it again. Exit 1
        when no trial has finished."""
        doc = _status(sweep, storage, folder)
        top = doc["best"]
        if top is None:
            print(f"no finished trial in sweep {doc['sweep']} yet", file=sys.stderr)
            raise typer.Exit(1)
        top = {**top, "best_config": doc["files"].get("best_config"), "importance": doc["files"].get("importance")}
        if json_out:
            print(json.dumps({"format": "apr-sweep-best", "format_version": "1", "sweep": doc["sweep"],
                              "metric": doc["metric"], "goal": doc["goal"], **top}, indent=1, default=str))
            return
        lines = [f"best trial {top['number']} of sweep {doc['sweep']}: {doc['metric']} {top['value']!r}"]
        lines += [f"  {k} = {fmt_setting(v)}" for k, v in top["params"].items()]
        lines.append(f"  run {top['run_id']} in {top['run_dir']}")
        if top["best_config"]:
            lines.append(f"  train it again: apr train apply {top['best_config']}")
        print("\n".join(lines))


def _echo(line: str) -> None:
    print(line, flush=True)


def _status(sweep: Path, storage: str | None, folder: Path | None) -> dict:
    from apr.sweep.planning import sweep_dir
    from apr.sweep.results import status_doc
    from apr.sweep.storage import default_url, display_url, open_study

    _check_folder(folder, sweep, None)
    spec = _load(sweep, None)
    where = sweep_dir(spec, folder)
    url = storage or default_url(where)
    study = open_study(spec, url, create=False)
    return status_doc(study, spec, where, display_url(url))


def _finish(spec, result) -> None:
    from apr.sweep.planning import check_base
    from apr.sweep.results import status_doc, write_reports
    from apr.sweep.storage import display_url, open_study

    study = open_study(spec, result.url, create=False)
    written = write_reports(study, spec, check_base(spec), result.folder)
    doc = status_doc(study, spec, result.folder, display_url(result.url), result.budget)
    counts = ", ".join(f"{n} {state}" for state, n in sorted(doc["counts"].items()))
    print(f"sweep {spec.name}: {counts or 'no trials'} of {result.budget}")
    if doc["best"] is not None:
        print(f"  best: trial {doc['best']['number']}, {spec.metric} {doc['best']['value']!r}")
    for name, path in written.items():
        print(f"  {name.replace('_', ' ')}: {path}")


def _status_text(doc: dict) -> str:
    keys = list(doc["trials"][0]["params"]) if doc["trials"] else []
    rows = [[str(r["number"]), r["state"], fmt_setting(r["value"]) if r["value"] is not None else "-",
             *[fmt_setting(r["params"].get(k)) for k in keys], safe_text(r["reason"] or "")[:90]]
            for r in doc["trials"]]
    head = f"sweep {doc['sweep']} ({doc['method']}, {doc['goal']} {doc['metric']}), storage {doc['storage']}"
    counts = ", ".join(f"{n} {state}" for state, n in sorted(doc["counts"].items())) or "no trials yet"
    table = text_table(["trial", "state", doc["metric"], *keys, "reason"], rows) if rows else ""
    best = doc["best"]
    tail = f"best: trial {best['number']}, {doc['metric']} {best['value']!r}" if best else "best: none finished yet"
    return "\n".join(x for x in (head, counts, table, tail) if x)


def _plan_text(result) -> str:
    doc = result.to_dict()
    total = doc["total"]
    what = (f"a sample of {doc['planned']} of its {doc['trial_count']} trials" if doc["sampled"]
            else f"all {doc['planned']} trials")
    lines = [f"sweep {doc['sweep']} ({doc['method']}, {doc['goal']} {doc['metric']}): planned {what}",
             f"  {doc['valid']} valid, {doc['invalid']} invalid (never trained: they cost nothing)"]
    keys = [p.key for p in result.spec.params]
    rows = []
    for i, t in enumerate(result.trials):
        seconds = fmt_duration(t.seconds) if t.seconds is not None else "-"
        rows.append([str(i), "valid" if t.valid else "invalid", *[fmt_setting(t.settings.get(k)) for k in keys],
                     f"{t.tokens:,}" if t.valid and t.tokens is not None else "-", seconds if t.valid else "-",
                     safe_text(t.reason())[:100]])
    lines.append(text_table(["#", "plan", *keys, "tokens", "time", "finding"], rows))
    valid = doc["valid"]
    if total["seconds"] is not None:
        time_text = fmt_duration(total["seconds"]) + (" (calibrated)" if total["calibrated"] else "")
    elif total["timed"]:  # a probe or finished run of some trials' shape, not of the others'
        time_text = (f"unknown: {valid - total['timed']} of {valid} valid trials have no probe or finished run of "
                     "their shape (probe one: `apr train plan --probe BASE KEY=VALUE...`, or name a GPU with --gpu)")
    else:
        time_text = "unknown (name a GPU with --gpu, or probe with `apr train plan --probe`)"
    cost = f", cost {total['cost']:.2f}" if total["cost"] is not None else ""
    tokens = f"{total['tokens']:,.0f}" if total["tokens"] is not None else "unknown"
    projected = "projected from the sample: " if doc["sampled"] else ""
    lines.append(f"sweep total ({projected}{total['valid_trials']:.3g} valid of {total['trials']} trials): "
                 f"tokens {tokens}, time {time_text}{cost}")
    return "\n".join(lines)
