"""`apr verify TEACHER STUDENT --batches N`: compare a distilled or upcycled student with its teacher
(per-block attention and logits mean/max L1 against thresholds; docs/eval.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from apr.cli.table import text_table
from apr.evaluate.compare import Thresholds, verify
from apr.fmt import fmt_sci


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify_cmd(
        teacher: Path = typer.Argument(..., show_default=False, help=(
            "The teacher: a checkpoint, a run directory or a Hugging Face folder.")),
        student: Path = typer.Argument(..., show_default=False, help="The student, in the same forms."),
        batches: int = typer.Option(5, "--batches", min=1, help="Batches to compare on."),
        data: Path | None = typer.Option(None, "--data", metavar="DIR", help=(
            "Pretokenized shards (default: the student's data.val, else data.train).")),
        batch_size: int | None = typer.Option(None, "--batch-size", min=1,
                                              help="Rows per batch (default: the student's data.batch_size)."),
        attention_mean: float = typer.Option(0.05, "--attention-max-mean-l1",
                                             help="Largest allowed mean |difference| of a block's attention output."),
        attention_max: float = typer.Option(0.25, "--attention-max-max-l1",
                                            help="Largest allowed |difference| of a block's attention output."),
        logits_mean: float = typer.Option(0.05, "--logits-max-mean-l1",
                                          help="Largest allowed mean |difference| of the logits."),
        logits_max: float = typer.Option(0.25, "--logits-max-max-l1",
                                         help="Largest allowed |difference| of the logits."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON document."),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    ) -> None:
        """Compare a student with its teacher. Exit 0 within every threshold, 1 otherwise or on an error."""
        result = verify(teacher, student, batches=batches, data=data, batch_size=batch_size, device=device,
                        thresholds=Thresholds(attention_mean, attention_max, logits_mean, logits_max))
        if json_out:
            typer.echo(json.dumps(result.to_dict(), indent=2))
        else:
            typer.echo(render(result))
        if not result.ok:
            raise typer.Exit(1)


def render(result) -> str:
    rows = [[r.what, fmt_sci(r.mean_l1), fmt_sci(r.max_mean_l1), fmt_sci(r.max_l1), fmt_sci(r.max_max_l1),
             "ok" if r.ok else "FAIL"] for r in result.rows]
    verdict = "within every threshold" if result.ok else "outside a threshold"
    return "\n".join([f"verify: {result.batches} batches, {result.tokens:,} tokens", "",
                      text_table(["WHAT", "MEAN L1", "LIMIT", "MAX L1", "LIMIT", ""], rows), "",
                      f"student {verdict}"])
