"""`apr data train-tokenizer` and `apr data pretokenize`."""

from __future__ import annotations

from pathlib import Path

import typer


def _render_error(err) -> None:
    from apr.cli.render import print_findings

    typer.echo(f"error: {err.message}", err=True)
    print_findings(err.findings)
    raise typer.Exit(1)


def _files(inputs, builtin, glob, max_bytes):
    from apr.data.corpus import builtin_corpus_files
    from apr.data.sources import expand_inputs
    from apr.errors import AprError, Finding

    if not inputs and not builtin:
        raise AprError("no input given", [Finding("error", "data.input", "give INPUT paths or --builtin stdlib",
                                                  expected="at least one input")])
    files = list(expand_inputs(inputs, glob)) if inputs else []
    if builtin:
        files += builtin_corpus_files(builtin, max_bytes)
    return files


def _source_names(files: list[Path]) -> list[str]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    names = []
    for f in files:
        try:
            names.append("stdlib:" + str(f.relative_to(root)))
        except ValueError:
            names.append(str(f))
    return names


def register(app: typer.Typer) -> None:
    @app.command("train-tokenizer")
    def train_tokenizer_cmd(
        inputs: list[Path] = typer.Argument(None, help="Files or folders of text.", show_default=False),
        vocab_size: str = typer.Option(..., "--vocab-size", help="Vocabulary size incl. special tokens (32K ok)."),
        out: Path = typer.Option(..., "--out", help="Where to write tokenizer.json."),
        special_token: list[str] = typer.Option(None, "--special-token", help="Special tokens (default <|endoftext|>)."),
        builtin: str = typer.Option(None, "--builtin", help="Use a built-in corpus: stdlib."),
        glob: str = typer.Option("**/*", "--glob", help="File pattern inside folders."),
        text_key: str = typer.Option("text", "--text-key", help="JSONL key holding the text."),
        text_column: str = typer.Option("text", "--text-column", help="Parquet column holding the text."),
        max_bytes: str = typer.Option("8M", "--max-bytes", help="Cap on the built-in corpus size."),
    ) -> None:
        """Train a byte-level BPE tokenizer (reproducible for the same input)."""
        from apr.config.numbers import parse_count
        from apr.data.sources import iter_documents
        from apr.data.tokenizer import train_tokenizer
        from apr.errors import AprError

        try:
            files = _files(inputs, builtin, glob, parse_count(max_bytes))
            info = train_tokenizer(iter_documents(files, text_key, text_column), parse_count(vocab_size), out,
                                   special_token or None)
        except AprError as err:
            _render_error(err)
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"tokenizer: {info['path']} (vocab {info['vocab_size']}, {len(files)} files)")

    @app.command("pretokenize")
    def pretokenize_cmd(
        inputs: list[Path] = typer.Argument(None, help="Files or folders: .txt, .jsonl, .parquet, text files.",
                                            show_default=False),
        tokenizer: Path = typer.Option(..., "--tokenizer", help="tokenizer.json"),
        seq_len: str = typer.Option(..., "--seq-len", help="Tokens per training sequence; rows hold seq_len + 1."),
        out: Path = typer.Option(..., "--out", help="Output folder (train/, val/, manifest.json)."),
        val_fraction: float = typer.Option(0.0, "--val-fraction", min=0.0, max=0.9, help="Rows held out for val."),
        shard_rows: int = typer.Option(4096, "--shard-rows", min=1, help="Rows per Parquet shard."),
        seed: int = typer.Option(0, "--seed", help="Seed of the train/val split."),
        builtin: str = typer.Option(None, "--builtin", help="Use a built-in corpus: stdlib."),
        glob: str = typer.Option("**/*", "--glob", help="File pattern inside folders."),
        text_key: str = typer.Option("text", "--text-key", help="JSONL key holding the text."),
        text_column: str = typer.Option("text", "--text-column", help="Parquet column holding the text."),
        input_column: str = typer.Option("input_ids", "--input-column", help="Name of the output token column."),
        max_bytes: str = typer.Option("8M", "--max-bytes", help="Cap on the built-in corpus size."),
    ) -> None:
        """Tokenize documents, pack them into rows of seq_len + 1 tokens and write Parquet shards."""
        import sys

        from apr.config.numbers import parse_count
        from apr.data.pretokenize import pretokenize
        from apr.data.sources import iter_documents
        from apr.errors import AprError

        try:
            files = _files(inputs, builtin, glob, parse_count(max_bytes))
            manifest = pretokenize(iter_documents(files, text_key, text_column), _source_names(files), tokenizer,
                                   parse_count(seq_len), out, val_fraction, shard_rows, seed, input_column,
                                   progress=sys.stderr.isatty())
        except AprError as err:
            _render_error(err)
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None
        splits = ", ".join(f"{k} {v['rows']} rows" for k, v in manifest["splits"].items())
        typer.echo(f"wrote {out}: {splits} of {manifest['seq_len'] + 1} tokens ({manifest['tokens_total']} tokens)")
