"""`apr experiment view` (curves and hyperparameters of several runs, in the terminal) and
`apr experiment export` (one run's metrics to Parquet or CSV)."""

from __future__ import annotations

import os
import shutil
import sys
from enum import StrEnum
from pathlib import Path

import typer


class ExportFormat(StrEnum):
    parquet = "parquet"
    csv = "csv"


def _error(err) -> int:
    from apr.cli.render import print_findings

    print(f"error: {err.message}", file=sys.stderr)
    print_findings(err.findings)
    return err.exit_code


def _colour() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def register(app: typer.Typer) -> None:
    @app.command("view")
    def view(
        db: Path = typer.Option(..., "--db", help="experiments.db, a run folder (.apr/experiments.db) or an APR_HOME."),
        runs: str | None = typer.Option(None, "--runs", help="Comma-separated run ids (or unique prefixes)."),
        metric: str = typer.Option("loss", "--metric", help="Metric to plot: loss, val_loss, lr, grad_norm, ..."),
        params: bool = typer.Option(False, "--params", help="Also print the hyperparameters that differ."),
        all_params: bool = typer.Option(False, "--all-params", help="With --params: print every parameter."),
        width: int | None = typer.Option(None, "--width", min=40, help="Chart width (default: terminal)."),
        height: int = typer.Option(24, "--height", min=10, help="Chart height in lines."),
    ) -> None:
        """Compare runs of one store: a terminal chart of a metric by step, and their params."""
        from apr.cli.cmd_runs import _table
        from apr.errors import AprError
        from apr.track.experiment import load_view, param_table, render_chart

        wanted = [r.strip() for r in runs.split(",") if r.strip()] if runs else None
        try:
            v = load_view(db, wanted, metric)
        except AprError as err:
            raise typer.Exit(_error(err)) from None
        if not v.series:
            print(f"no runs in {v.db}", file=sys.stderr)
            raise typer.Exit(0)
        cols = width or min(shutil.get_terminal_size((100, 24)).columns, 160)
        print(render_chart(v, width=cols, height=height, colour=_colour()))
        for note in v.notes:
            print(f"note: {note}", file=sys.stderr)
        if params or all_params:
            header, rows, hidden = param_table(v, all_params=all_params)
            print()
            print(_table(header, rows) if rows else "(no params differ)")
            if hidden:
                print(f"({hidden} params equal across these runs not shown; --all-params shows them)")

    @app.command("export")
    def export(
        db: Path = typer.Option(..., "--db", help="experiments.db, a run folder (.apr/experiments.db) or an APR_HOME."),
        run: str = typer.Option(..., "--run", help="Run id (or a unique prefix)."),
        fmt: ExportFormat = typer.Option(..., "--format", help="parquet or csv."),
        output: Path = typer.Option(..., "--out", "--output", help="File to write (replaced atomically)."),
    ) -> None:
        """Write one run's metrics as a table: step, time, and one column per metric."""
        from apr.errors import AprError
        from apr.track.experiment import export_run

        try:
            result = export_run(db, run, fmt.value, output)
        except AprError as err:
            raise typer.Exit(_error(err)) from None
        print(f"wrote {result.rows} rows x {len(result.columns)} columns to {result.path}")
