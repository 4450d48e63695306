"""`apr eval SOURCE --data DIR --task NAME|FILE`: loss over shards and multiple-choice accuracy
(docs/eval.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from apr.cli.render import print_findings
from apr.cli.table import text_table
from apr.errors import AprError, Finding
from apr.evaluate.loss import overall
from apr.evaluate.report import run_eval
from apr.evaluate.tasks import ON_ERROR


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        source: Path = typer.Argument(..., show_default=False, help=(
            "checkpoint-*.json or .safetensors, a run directory (its latest good checkpoint), or a "
            "folder written by apr export.")),
        data: list[str] = typer.Option([], "--data", metavar="DIR", help=(
            "Pretokenized shards: loss, perplexity, bits per byte (per subfolder when several); repeatable.")),
        task: list[str] = typer.Option([], "--task", metavar="NAME|FILE", help=(
            "Multiple-choice task: stdlib-nextline (built in) or a JSONL file; repeatable.")),
        limit: int | None = typer.Option(None, "--limit", min=1, help="Examples per task at most."),
        on_error: str = typer.Option("stop", "--on-error", metavar="stop|skip",
                                     help="A malformed task line stops (default) or is skipped."),
        batch_size: int | None = typer.Option(None, "--batch-size", min=1,
                                              help="Rows per batch (default: the run's data.batch_size)."),
        max_batches: int | None = typer.Option(None, "--max-batches", min=1,
                                               help="Batches per data source at most (default: all)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the built-in task's examples."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
        tokenizer: Path | None = typer.Option(None, "--tokenizer", help="tokenizer.json (default: the source's)."),
    ) -> None:
        """Measure a model: loss over shards, accuracy on multiple-choice tasks. Exit 0 ok, 1 error."""
        from apr.generate.load import load_for_inference

        if on_error not in ON_ERROR:

            raise AprError(f"--on-error must be stop or skip, not {on_error!r}", [Finding(
                "error", "eval.option", "unknown --on-error", path="--on-error", expected="stop or skip",
                got=on_error)])
        loaded = load_for_inference(source, tokenizer=tokenizer, device=device, need_tokenizer=bool(task))
        for w in loaded.warnings:
            typer.echo(f"warning: {w}", err=True)
        report = run_eval(loaded, data, task, batch_size=batch_size, max_batches=max_batches, limit=limit,
                          on_error=on_error, seed=seed)
        if report.skipped:

            typer.echo(f"warning: skipped {len(report.skipped)} malformed task lines:", err=True)
            print_findings(report.skipped)
        if json_out:
            typer.echo(json.dumps(report.to_dict(loaded), indent=2))
            return
        typer.echo(render_report(report, loaded))


def render_report(report, loaded) -> str:

    step = f" (step {loaded.step})" if loaded.step is not None else ""
    out = [f"eval of {loaded.source}{step} on {loaded.device}"]
    if report.data:
        rows = [[s.name, f"{s.rows:,}", f"{s.tokens:,}", f"{s.loss:.4f}", f"{s.perplexity:.2f}",
                 f"{s.bits_per_byte:.4f}" if s.bits_per_byte is not None else "-"] for s in report.data]
        if len(report.data) > 1:
            o = overall(report.data)
            rows.append(["(all)", "", f"{o['tokens']:,}", f"{o['loss']:.4f}", f"{o['perplexity']:.2f}", ""])
        out += ["", text_table(["DATA", "ROWS", "TOKENS", "LOSS", "PPL", "BITS/BYTE"], rows)]
    if report.tasks:
        rows = [[t.name, f"{t.examples:,}", f"{t.acc:.3f}", f"{t.acc_norm:.3f}", f"{t.chance:.3f}",
                 str(t.skipped) if t.skipped else ""] for t in report.tasks]
        out += ["", text_table(["TASK", "EXAMPLES", "ACC", "ACC_NORM", "CHANCE", "SKIPPED"], rows)]
    return "\n".join(out)
