"""`apr profile SOURCE`: per-layer time and memory of a training step, inference latency, and the
plan's figures beside the measured ones; for a config, the step of the engine its run would build
(docs/profile.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("profile")
    def profile_cmd(
        source: Path = typer.Argument(..., show_default=False, help=(
            "checkpoint-*.json or .safetensors, a run directory (its latest good checkpoint), a "
            "folder written by apr export, or a config (.yaml): the engine its run would build.")),
        prompt: str | None = typer.Option(None, "--prompt", "-p", help=(
            "Text whose tokens fill the latency prompts (repeated to each --length); default: fixed ids.")),
        length: list[int] = typer.Option([], "--length", "-l", help=(
            "Prompt length in tokens to time (repeatable; default: the prompt's length, else 128).")),
        new_tokens: int = typer.Option(32, "--new-tokens", "-n", help="Tokens decoded after each prefill."),
        repeats: int = typer.Option(5, "--repeats", help="Prefills (and decode runs) per length."),
        batch_size: int | None = typer.Option(None, "--batch-size", help=(
            "Training-step batch (default: the run's; for a config, its micro-batch data.batch_size).")),
        seq_len: int | None = typer.Option(None, "--seq-len", help=(
            "Training-step sequence length (default: the run's, at most the context).")),
        steps: int = typer.Option(3, "--steps", help="Profiled steps (and as many unprofiled) to take medians over."),
        precision: str | None = typer.Option(None, "--precision", help=(
            "fp32, bf16 or fp16 (default: a config's mixed_precision; for weights fp32 on the CPU, the run's "
            "mixed_precision on a GPU).")),
        no_step: bool = typer.Option(False, "--no-step", help="Skip the training step."),
        no_latency: bool = typer.Option(False, "--no-latency", help="Skip inference latency."),
        compare: bool = typer.Option(False, "--compare", help="Show the plan's FLOPs and memory beside the measured."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
        device: str | None = typer.Option(None, "--device", help=(
            "cpu or cuda (default: a config's training.device; for weights, cpu).")),
        tokenizer: Path | None = typer.Option(None, "--tokenizer", help=(
            "tokenizer.json for --prompt (default: the source's).")),
    ) -> None:
        """Time and measure a model: one training step layer by layer, prefill and decode latency.
        Exit 0 ok, 1 error."""
        from apr.profile.render import render_text
        from apr.profile.report import ProfileOptions, profile_source

        options = ProfileOptions(
            device=device, precision=precision, batch_size=batch_size, seq_len=seq_len, steps=steps, prompt=prompt,
            lengths=tuple(length), new_tokens=new_tokens, repeats=repeats, step=not no_step, latency=not no_latency,
            compare=compare, tokenizer=tokenizer)
        report = profile_source(source, options)
        typer.echo(json.dumps(report.to_dict(), indent=2) if json_out else render_text(report))
