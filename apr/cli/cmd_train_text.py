"""`apr train text FILE`: train a small model straight from one text file (docs/data.md, "Training
straight from a text file"): a tokenizer, shards and a config written under --out, then the run."""

from __future__ import annotations

from pathlib import Path

import typer

from apr.errors import AprError, Finding


def register(app: typer.Typer) -> None:
    @app.command("text")
    def text_cmd(
        text: Path = typer.Argument(..., show_default=False, help="A UTF-8 text file to train on."),
        out: Path = typer.Option(..., "--out", metavar="DIR", show_default=False,
                                 help="Folder for tokenizer.json, data/, config.yaml and the run (run/)."),
        tokenizer: str = typer.Option("char", "--tokenizer", help="char (one token per character) or bpe."),
        vocab_size: int | None = typer.Option(None, "--vocab-size", min=3, show_default=False,
                                              help="Tokenizer size (char: at most this many; bpe default 4096)."),
        seq_len: int = typer.Option(128, "--seq-len", min=1, help="Training sequence length."),
        max_steps: int | None = typer.Option(None, "--max-steps", min=1, show_default=False,
                                             help="Optimizer steps (default: one pass over the text)."),
        device: str | None = typer.Option(None, "--device", show_default=False, help="cpu, cuda or auto."),
        prepare_only: bool = typer.Option(False, "--prepare-only", help="Write the files; do not train."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Reuse a non-empty --out folder."),
    ) -> None:
        """Prepare a text file and train on it in one command. Exit 0 finished, 1 error."""
        from apr.data.textrun import prepare_text_run  # lazy: tokenizers and pyarrow

        if tokenizer not in ("char", "bpe"):
            raise AprError(f"unknown --tokenizer {tokenizer!r}", [Finding(
                "error", "data.kind", "unknown tokenizer kind", path="--tokenizer", expected="char or bpe",
                got=tokenizer)])
        run = prepare_text_run(text, out, kind=tokenizer, vocab_size=vocab_size, seq_len=seq_len,
                               max_steps=max_steps, overwrite=overwrite)
        typer.echo(f"prepared {out}: {tokenizer} tokenizer of {run.vocab_size} ids, {run.train_rows:,} train and "
                   f"{run.val_rows:,} val rows of {seq_len + 1} tokens, {run.config}")
        if prepare_only:
            typer.echo(f"train with: apr train apply {run.config}")
            return
        from apr.apply import run_apply  # lazy: torch

        result = run_apply(run.config, device=device, echo=typer.echo)
        val = "" if result.val_loss is None else f", val loss {result.val_loss:.4f}"
        typer.echo(f"run {result.run_id}: {result.status}, step {result.final_step}{val}; generate with: "
                   f"apr generate {result.run_dir} --prompt TEXT")
        raise typer.Exit(result.exit_code)
