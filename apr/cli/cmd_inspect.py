"""`apr inspect SOURCE [OTHER]`: weight statistics and histograms per layer, the update between two
checkpoints, attention maps for a prompt (docs/inspect.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from apr.fsutil import check_output_folder


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_cmd(
        source: Path = typer.Argument(..., show_default=False, help=(
            "checkpoint-*.json or .safetensors, a run directory, a Hugging Face folder, or a .safetensors file.")),
        other: Path | None = typer.Argument(None, show_default=False, help=(
            "A second checkpoint: show how far each layer moved from SOURCE to it.")),
        tensor: list[str] = typer.Option([], "--tensor", help=(
            "Only tensors whose name matches this glob, e.g. '*layers.3.*' (repeatable).")),
        bins: int = typer.Option(40, "--bins", help="Histogram bins per layer."),
        prompt: str | None = typer.Option(None, "--prompt", "-p", help="Show attention maps for this text."),
        layer: list[int] = typer.Option([], "--layer", help="Attention of this layer only (repeatable)."),
        head: list[int] = typer.Option([], "--head", help="Attention of this head only (repeatable)."),
        tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer.json (default: the source's)."),
        out: Path | None = typer.Option(None, "--out", metavar="DIR", help=(
            "Write the pictures (histograms, updates, attention) as files in this folder.")),
        fmt: str = typer.Option("svg", "--format", help="svg or png, for --out."),
        overwrite: bool = typer.Option(False, "--overwrite", help=(
            "Replace pictures of an earlier `apr inspect --out` in DIR (never apr's records).")),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
    ) -> None:
        """Look inside checkpoints: weights, updates between two, attention. Exit 0 ok, 1 error."""
        from apr.inspect.render import render_text
        from apr.inspect.report import InspectOptions, inspect

        if out is not None:  # refused before anything is read: a file, FIFO, device, symlink, apr's records
            check_output_folder(out, inputs=[source, *([other] if other else [])], option="--out")
        options = InspectOptions(bins=bins, tensors=tuple(tensor), prompt=prompt, layers=tuple(layer),
                                 heads=tuple(head), tokenizer=tokenizer, out=out, fmt=fmt, overwrite=overwrite)
        report = inspect(source, other, options, warn=lambda m: typer.echo(f"warning: {m}", err=True))
        typer.echo(json.dumps(report.to_dict(), indent=2) if json_out else render_text(report))
