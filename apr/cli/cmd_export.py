"""`apr export CHECKPOINT --format hf|peft --out DIR`: a checkpoint as a Hugging Face Llama folder, or a
LoRA checkpoint's adapters as a PEFT folder."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer

from apr.fsutil import check_output_folder


class ExportFormat(StrEnum):
    hf = "hf"
    peft = "peft"


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export(
        checkpoint: Path = typer.Argument(
            ..., show_default=False,
            help="checkpoint-*.json or .safetensors, or a run directory (its latest good checkpoint)."),
        fmt: ExportFormat = typer.Option(
            ExportFormat.hf, "--format", help="hf: a transformers folder (LoRA adapters merged in); "
            "peft: a LoRA checkpoint's (or a stacked run's trunk) adapters as a PEFT adapter folder."),
        out: Path = typer.Option(..., "--out", metavar="DIR", help="Folder to create.", show_default=False),
        tokenizer: Path | None = typer.Option(
            None, "--tokenizer", help="tokenizer.json to ship (default: the config's data.tokenizer)."),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Replace an earlier export in --out (only if it holds nothing else)."),
        base: Path | None = typer.Option(
            None, "--base", metavar="HF_DIR", show_default=False,
            help="--format peft: a Hugging Face folder of the adapters' base weights to point at (default: "
                 "the base is exported into DIR/base)."),
    ) -> None:
        """Export weights, config and tokenizer so transformers loads them offline. Exit 0 ok, 1 error."""
        from apr.checkpoint.export import export_hf
        from apr.generate.load import refuse_masked_lm_source  # lazy: torch, through the export module

        check_output_folder(out, inputs=[checkpoint], option="--out")  # the output first, as export_hf does
        refuse_masked_lm_source(checkpoint, "exported as a Hugging Face causal LM")
        result = export_hf(checkpoint, out, tokenizer=tokenizer, overwrite=overwrite, fmt=fmt.value, base=base)
        for w in result.warnings:
            typer.echo(f"warning: {w}", err=True)
        typer.echo(f"exported {result.checkpoint.name} (step {result.step}) to {result.out_dir}")
        if fmt == ExportFormat.peft:
            adapters = str(result.out_dir.absolute())
            typer.echo(f"  files: {', '.join(result.files)}")
            typer.echo(f"  base: {result.base} ({'--base' if base is not None else 'exported with the adapters'}; "
                       "adapter_config.json names it by this absolute path)")
            typer.echo("  load with: from transformers import AutoModelForCausalLM; from peft import PeftModel; "
                       f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(result.base)!r}), "
                       f"{adapters!r})")
            typer.echo(f"  or: from peft import AutoPeftModelForCausalLM; "
                       f"model = AutoPeftModelForCausalLM.from_pretrained({adapters!r})")
            return
        typer.echo(f"  files: {', '.join(result.files)}")
        typer.echo(f"  eos token: {result.eos_token or '(none)'}; RoPE as {result.rope_form}")
        typer.echo(f"  load with: AutoModelForCausalLM.from_pretrained({str(result.out_dir)!r})")
