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
        from apr.track.experiment import load_view, param_table, render_chart

        wanted = [r.strip() for r in runs.split(",") if r.strip()] if runs else None
        v = load_view(db, wanted, metric)
        if not v.series:
            print(f"no runs in {v.db}", file=sys.stderr)
            raise typer.Exit(0)
        cols = width or min(shutil.get_terminal_size((100, 24)).columns, 160)
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
        run: str = typer.Option(..., "--run", help="Run id (or a unique prefix)."),
        fmt: ExportFormat = typer.Option(..., "--format", help="parquet or csv."),
        output: Path | None = typer.Option(None, "--out", metavar="FILE", show_default=False,
                                           help="File to write (a new path; written atomically)."),
        output_alias: Path | None = typer.Option(None, "--output", hidden=True),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    ) -> None:
        """Write one run's metrics as a table: step, time, and one column per metric."""
        from apr.track.experiment import export_run

        if output is not None and output_alias is not None:
            raise typer.BadParameter("give --out once (--output is its old name)", param_hint="'--output'")
        if output is None and output_alias is None:
            raise typer.BadParameter("missing --out FILE", param_hint="'--out'")
        result = export_run(db, run, fmt.value, output or output_alias, overwrite=overwrite)
        print(f"wrote {result.rows} rows x {len(result.columns)} columns to {result.path}")
