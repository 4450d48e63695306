"""`apr export CHECKPOINT --format hf --out DIR`: a checkpoint as a Hugging Face Llama folder."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer


class ExportFormat(StrEnum):
    hf = "hf"


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export(
        checkpoint: Path = typer.Argument(
            ..., show_default=False,
            help="checkpoint-*.json or .safetensors, or a run directory (its latest good checkpoint)."),
        fmt: ExportFormat = typer.Option(ExportFormat.hf, "--format", help="Output format (hf)."),
        out: Path = typer.Option(..., "--out", metavar="DIR", help="Folder to create.", show_default=False),
        tokenizer: Path | None = typer.Option(
            None, "--tokenizer", help="tokenizer.json to ship (default: the config's data.tokenizer)."),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Replace an earlier export in --out (only if it holds nothing else)."),
    ) -> None:
        """Export weights, config and tokenizer so transformers loads them offline. Exit 0 ok, 1 error."""
        from apr.checkpoint.export import export_hf

        result = export_hf(checkpoint, out, tokenizer=tokenizer, overwrite=overwrite)
        for w in result.warnings:
            typer.echo(f"warning: {w}", err=True)
        typer.echo(f"exported {result.checkpoint.name} (step {result.step}) to {result.out_dir}")
        typer.echo(f"  files: {', '.join(result.files)}")
        typer.echo(f"  eos token: {result.eos_token or '(none)'}; RoPE as {result.rope_form}")
        typer.echo(f"  load with: AutoModelForCausalLM.from_pretrained({str(result.out_dir)!r})")
