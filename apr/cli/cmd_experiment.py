"""`apr experiment view` (curves and hyperparameters of several runs, in the terminal) and
`apr experiment export` (one run's metrics to Parquet or CSV)."""

from __future__ import annotations

import os
import shutil
import sys
from enum import StrEnum
from pathlib import Path

import typer

from apr.cli.table import text_table
from apr.fmt import safe_text


class ExportFormat(StrEnum):
    parquet = "parquet"
    csv = "csv"


class Chart(StrEnum):
    line = "line"
    loss_curve = "loss_curve"  # albor's name for the line chart
    bar = "bar"


class Tracker(StrEnum):
    tensorboard = "tensorboard"
    mlflow = "mlflow"


def _colour() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def register(app: typer.Typer) -> None:
    @app.command("view")
    def view(
        db: Path | None = typer.Option(None, "--db", help=(
            "experiments.db, a run folder (.apr/experiments.db) or an APR_HOME (default: the global registry, "
            "$APR_HOME/experiments.db).")),
        experiment: str | None = typer.Option(None, "--experiment", "-e", help=(
            "Only runs of this experiment (monitoring.tracking.experiment).")),
        runs: str | None = typer.Option(None, "--runs", help="Comma-separated run ids (or unique prefixes)."),
        forks: bool = typer.Option(False, "--forks", help=(
            "Also draw the runs forked from these (apr train fork), and their forks, over them.")),
        chart: Chart = typer.Option(Chart.line, "--chart", help=(
            "line (loss_curve): the metric by step, one curve per run; bar: each run's last value.")),
        metric: str = typer.Option("loss", "--metric", help="Metric to plot: loss, val_loss, lr, grad_norm, ..."),
        params: bool = typer.Option(False, "--params", help="Also print the hyperparameters that differ."),
        all_params: bool = typer.Option(False, "--all-params", help="With --params: print every parameter."),
        width: int | None = typer.Option(None, "--width", min=40, max=1000,
                                         help="Chart width, 40 to 1000 (default: terminal)."),
        height: int = typer.Option(24, "--height", min=10, max=500, help="Chart height in lines, 10 to 500."),
    ) -> None:
        """Compare runs of one store: a terminal chart of a metric by step, and their params."""
        from apr.track.experiment import load_view, param_table, render_bars, render_chart
        from apr.track.names import global_db_path

        wanted = [r.strip() for r in runs.split(",") if r.strip()] if runs else None
        v = load_view(db if db is not None else global_db_path(), wanted, metric, experiment=experiment, forks=forks)
        if not v.series:
            print(f"no runs in {v.db}", file=sys.stderr)
            raise typer.Exit(0)
        cols = width or min(shutil.get_terminal_size((100, 24)).columns, 160)
        if chart == Chart.bar:
            print(render_bars(v, width=cols))
        else:
            print(render_chart(v, width=cols, height=height, colour=_colour()))
        for note in v.notes:
            print(f"note: {safe_text(note)}", file=sys.stderr)
        if params or all_params:
            header, rows, hidden = param_table(v, all_params=all_params)
            print()
            cells = [[safe_text(c) for c in r] for r in rows]
            print(text_table([safe_text(h) for h in header], cells) if rows else "(no params differ)")
            if hidden:
                print(f"({hidden} params equal across these runs not shown; --all-params shows them)")

    @app.command("export")
    def export(
        db: Path = typer.Option(..., "--db", help="experiments.db, a run folder (.apr/experiments.db) or an APR_HOME."),
        run: list[str] | None = typer.Option(None, "--run", help="Run id (or a unique prefix); with --to it may be "
                                                               "repeated or left out (every run in the store)."),
        fmt: ExportFormat | None = typer.Option(None, "--format", help="parquet or csv: one run as a table."),
        to: Tracker | None = typer.Option(None, "--to", help="tensorboard or mlflow: runs into a tracker."),
        output: Path | None = typer.Option(None, "--out", metavar="PATH", show_default=False,
                                           help="--format: the file to write (a new path; written atomically). "
                                                "--to tensorboard: the log folder; --to mlflow: a SQLite file."),
        uri: str | None = typer.Option(None, "--uri", metavar="URI", help="--to mlflow: a tracking URI instead "
                                                                          "of --out (http://HOST:PORT, ...)."),
        output_alias: Path | None = typer.Option(None, "--output", hidden=True),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file (--to mlflow, "
                                                                  "--to tensorboard: runs already exported)."),
    ) -> None:
        """Write one run's metrics as a table (--format), or runs into TensorBoard or MLflow (--to)."""
        from apr.track.experiment import export_run, export_to_tracker

        if output is not None and output_alias is not None:
            raise typer.BadParameter("give --out once (--output is its old name)", param_hint="'--output'")
        output = output or output_alias
        if (fmt is None) == (to is None):
            raise typer.BadParameter("give either --format (a table file) or --to (a tracker)", param_hint="'--to'")
        if to is not None:
            dest = uri if uri is not None and to == Tracker.mlflow else None
            if uri is not None and to != Tracker.mlflow:
                raise typer.BadParameter("--uri is for --to mlflow", param_hint="'--uri'")
            if dest is None and output is None:
                raise typer.BadParameter("missing --out PATH" + (" or --uri URI" if to == Tracker.mlflow else ""),
                                         param_hint="'--out'")
            done = export_to_tracker(db, run or None, to.value, dest or str(output), overwrite=overwrite)
            for rid, points, where in done.runs:
                print(f"{rid}: {points} metric points -> {where}")
            for rid, why in done.skipped:
                print(f"{rid}: skipped, {why}")
            return
        if not run or len(run) != 1:
            raise typer.BadParameter("--format exports one run: give --run ID once", param_hint="'--run'")
        if output is None:
            raise typer.BadParameter("missing --out FILE", param_hint="'--out'")
        result = export_run(db, run[0], fmt.value, output, overwrite=overwrite)
        print(f"wrote {result.rows} rows x {len(result.columns)} columns to {result.path}")
