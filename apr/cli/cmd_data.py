"""`apr data train-tokenizer` and `apr data pretokenize`: parse, call apr.data, render."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from apr.config.numbers import parse_bytes, parse_count
from apr.data.corpus import builtin_corpus_files
from apr.data.sources import expand_inputs, iter_documents
from apr.data.tokenizer import train_char_tokenizer, train_tokenizer
from apr.errors import AprError, Finding
from apr.fsutil import check_output_file, check_output_folder


def _count(value: str, flag: str) -> int:
    try:
        return parse_count(value)
    except ValueError as e:
        raise AprError(f"{flag}: {e}", [Finding("error", "cli.value", str(e), path=flag)]) from None


def _size(value: str, flag: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise AprError(f"{flag}: {e}", [Finding("error", "cli.value", str(e), path=flag, expected="a size such as "
                                                "4MB or 512KiB", got=repr(value))]) from None


def _files(inputs: list[Path] | None, builtin: str | None, glob: str | None, builtin_max_bytes: str) -> list[Path]:

    if not inputs and not builtin:
        raise AprError("no input given", [Finding("error", "data.input", "give INPUT files or folders, or --builtin "
                                                  "stdlib", expected="at least one input")])
    files = expand_inputs(list(inputs), glob) if inputs else []
    if builtin:
        files += builtin_corpus_files(builtin, _size(builtin_max_bytes, "--builtin-max-bytes"))
    return files


def _split_tokens(values: list[str] | None) -> list[str]:
    return [t.strip() for v in values or [] for t in v.split(",") if t.strip()]


def _pretokenize_sources(values: list[str], inputs, builtin, tokenizer: Path, seq_len: int, out: Path,
                         overwrite: bool, **options) -> None:
    from apr.data.pretokenize_sources import parse_sources, pretokenize_sources

    if inputs or builtin:
        raise AprError("--source with INPUTS or --builtin", [Finding(
            "error", "data.source", "each input belongs to a named source", path="--source",
            expected="only --source NAME=PATH options", got="INPUTS or --builtin too")])
    t0 = time.monotonic()
    m = pretokenize_sources(parse_sources(values), tokenizer, seq_len, out, overwrite=overwrite, **options)
    typer.echo(f"wrote {out}: {len(m['sources'])} sources of {m['row_len']} tokens (seq_len {m['seq_len']}) "
               f"in {time.monotonic() - t0:.1f} s")
    for name, info in m["sources"].items():
        rows = ", ".join(f"{split} {n:,} rows" for split, n in info["rows"].items())
        typer.echo(f"  {name:<12} {rows}; {info['tokens_total']:,} tokens from {info['documents']:,} documents")


class ProgressLine:
    """A one-line progress report on stderr: redrawn in place on a terminal (after half a second),
    else printed as a plain line every ``log_every`` seconds once the work has taken that long."""

    def __init__(self, label: str, stream=None, tty: bool | None = None, log_every: float = 10.0):
        self.label, self.stream = label, stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.log_every = log_every
        self.t0 = time.monotonic()
        self.last = float("-inf")  # time of the last line drawn
        self.drawn = False

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.monotonic()
        elapsed = now - self.t0
        if self.tty:
            if elapsed < 0.5 or now - self.last < 0.1:
                return
        elif elapsed < self.log_every or now - self.last < self.log_every:
            return
        self.last = now
        self._draw(done, total, tokens, elapsed, final=False)

    def _draw(self, done: int, total: int, tokens: int, elapsed: float, final: bool) -> None:
        frac = min(done / total, 1.0) if total else 0.0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        eta = (elapsed / frac - elapsed) if 0 < frac < 1 else 0.0
        text = (f"{self.label} {frac:4.0%} {done / 1e6:.1f}/{total / 1e6:.1f} MB, {tokens / 1e6:.2f}M tokens, "
                f"{rate / 1e6:.2f}M tokens/s" + ("" if final else f", eta {eta:.0f}s"))
        if self.tty:
            bar = "#" * int(frac * 20)
            self.stream.write(f"\r{self.label} [{bar:<20}] " + text[len(self.label) + 1:] + "\x1b[K")
            self.drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


# The input options both commands share (typer option objects can serve as defaults of several commands).
_INPUTS = typer.Argument(None, show_default=False,
                         help="Files or folders (.txt, .jsonl, .parquet; folders are searched recursively).")
_BUILTIN = typer.Option(None, "--builtin", show_default=False,
                        help="Add a built-in corpus: stdlib (this Python's standard library).")
_BUILTIN_MAX_BYTES = typer.Option("4MB", "--builtin-max-bytes", metavar="SIZE",
                                  help="Size cap of the built-in corpus (4MB, 512KiB, 1GiB).")
_GLOB = typer.Option(None, "--glob", show_default=False,
                     help="Files to take in folders, e.g. '**/*.md' (default: .txt .jsonl .parquet).")
_TEXT_KEY = typer.Option("text", "--text-key", help="Key of the text in .jsonl objects.")
_TEXT_COLUMN = typer.Option("text", "--text-column", help="Column of the text in .parquet files.")


def register(app: typer.Typer) -> None:
    @app.command("train-tokenizer")
    def train_tokenizer_cmd(
        inputs: list[Path] = _INPUTS,
        vocab_size: str = typer.Option(None, "--vocab-size", show_default=False,
                                       help="Vocabulary size including special tokens (32768, 32_768, 32K); "
                                            "required for bpe; char: at most this many (default: every character)."),
        kind: str = typer.Option("bpe", "--kind", help="bpe (byte-level BPE) or char (one token per character)."),
        out: Path = typer.Option(..., "--out", metavar="FILE", show_default=False,
                                 help="The tokenizer.json to write."),
        special_tokens: list[str] = typer.Option(
            None, "--special-tokens", "--special-token", show_default=False,
            help="Extra special tokens, repeatable or comma-separated; <|endoftext|> is always id 0."),
        min_frequency: int = typer.Option(2, "--min-frequency", min=1, help="Fewest occurrences of a merged pair."),
        builtin: str = _BUILTIN,
        builtin_max_bytes: str = _BUILTIN_MAX_BYTES,
        glob: str = _GLOB,
        text_key: str = _TEXT_KEY,
        text_column: str = _TEXT_COLUMN,
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    ) -> None:
        """Train a byte-level BPE or a character tokenizer; the same input gives a byte-identical file. Exit 0 ok,
        1 error."""

        t0 = time.monotonic()
        if kind not in ("bpe", "char"):
            raise AprError(f"unknown --kind {kind!r}", [Finding(
                "error", "data.kind", "unknown tokenizer kind", path="--kind", expected="bpe or char", got=kind)])
        if kind == "bpe" and vocab_size is None:
            raise AprError("--kind bpe needs --vocab-size", [Finding(
                "error", "data.vocab_size", "a byte-level BPE is trained to a vocabulary size", path="--vocab-size",
                expected="a size such as 32K", got="none")])
        files = _files(inputs, builtin, glob, builtin_max_bytes)
        check_output_file(out, inputs=files, overwrite=overwrite)
        documents = iter_documents(files, text_key, text_column)
        if kind == "char":
            size = None if vocab_size is None else _count(vocab_size, "--vocab-size")
            info = train_char_tokenizer(documents, size, out, _split_tokens(special_tokens))
        else:
            info = train_tokenizer(documents, _count(vocab_size, "--vocab-size"), out, _split_tokens(special_tokens),
                                   min_frequency, show_progress=sys.stderr.isatty())
        if info["vocab_size"] < info["requested_vocab_size"]:
            typer.echo(f"warning: the input allows only {info['vocab_size']} tokens, fewer than --vocab-size "
                       f"{info['requested_vocab_size']}; give more text or a smaller size", err=True)
        typer.echo(f"wrote {info['path']}: vocab {info['vocab_size']:,} ({', '.join(info['special_tokens'])}), "
                   f"trained on {info['documents']:,} documents, {info['chars'] / 1e6:.1f}M characters "
                   f"from {len(files):,} files in {time.monotonic() - t0:.1f} s")
        typer.echo(f"  sha256 {info['sha256']}")

    @app.command("pretokenize")
    def pretokenize_cmd(
        inputs: list[Path] = _INPUTS,
        tokenizer: Path = typer.Option(..., "--tokenizer", show_default=False, help="A tokenizer.json."),
        seq_len: str = typer.Option(..., "--seq-len", show_default=False,
                                    help="Training sequence length; each row holds seq_len + 1 tokens."),
        out: Path = typer.Option(..., "--out", metavar="DIR", show_default=False,
                                 help="Folder to create: train/, val/, manifest.json."),
        val_fraction: float = typer.Option(0.0, "--val-fraction", help="Share of rows held out in val/ (0 <= F < 1)."),
        shard_rows: int = typer.Option(4096, "--shard-rows", min=1, help="Rows per Parquet shard."),
        seed: int = typer.Option(0, "--seed", min=0, help="Seed of the train/val split."),
        builtin: str = _BUILTIN,
        builtin_max_bytes: str = _BUILTIN_MAX_BYTES,
        glob: str = _GLOB,
        text_key: str = _TEXT_KEY,
        text_column: str = _TEXT_COLUMN,
        eot_token: str = typer.Option(None, "--eot-token", show_default=False,
                                      help="Token appended after each document (default: <|endoftext|>, </s>, ...)."),
        input_column: str = typer.Option("input_ids", "--input-column", help="Name of the token column written."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out folder."),
        source: list[str] = typer.Option(None, "--source", metavar="NAME=PATH", show_default=False,
                                         help="A named source of a mixture (repeat; OUT/NAME per source and "
                                              "OUT/manifest.json with each source's size). Not with INPUTS."),
    ) -> None:
        """Tokenize documents, pack them into rows of seq_len + 1 tokens, write Parquet shards. Exit 0 ok, 1 error."""
        from apr.data.pretokenize import pretokenize

        t0 = time.monotonic()
        if source:
            _pretokenize_sources(source, inputs, builtin, tokenizer, _count(seq_len, "--seq-len"), out, overwrite,
                                 val_fraction=val_fraction, shard_rows=shard_rows, seed=seed, glob=glob,
                                 text_key=text_key, text_column=text_column, column=input_column,
                                 eot_token=eot_token)
            return
        progress = ProgressLine("pretokenize")
        try:
            files = _files(inputs, builtin, glob, builtin_max_bytes)
            manifest = pretokenize(files, tokenizer, _count(seq_len, "--seq-len"), out, val_fraction=val_fraction,
                                   shard_rows=shard_rows, seed=seed, text_key=text_key, text_column=text_column,
                                   column=input_column, eot_token=eot_token, overwrite=overwrite, progress=progress)
        finally:
            progress.close()
        seconds = time.monotonic() - t0
        splits = manifest["splits"]
        parts = ", ".join(f"{name} {info['rows']:,} rows in {len(info['shards'])} shard"
                          + ("" if len(info["shards"]) == 1 else "s") for name, info in splits.items())
        typer.echo(f"wrote {out}: {parts} of {manifest['row_len']} tokens (seq_len {manifest['seq_len']})")
        typer.echo(f"  {manifest['tokens_total']:,} tokens from {manifest['documents']:,} documents in "
                   f"{len(files):,} files, {seconds:.1f} s ({manifest['tokens_total'] / max(seconds, 1e-9) / 1e6:.2f}M "
                   f"tokens/s); {manifest['tokens_dropped']:,} tokens of the last partial row dropped")

    @app.command("synth")
    def synth_cmd(
        like: Path = typer.Option(..., "--like", metavar="CONFIG", show_default=False,
                                  help="The training config whose data to imitate."),
        out: Path = typer.Option(..., "--out", metavar="DIR", show_default=False,
                                 help="Folder under which the config's relative data paths are written."),
        train_rows: int | None = typer.Option(None, "--train-rows", min=1, show_default=False,
                                              help="Train sequences (default: what the config's run consumes)."),
        val_rows: int | None = typer.Option(None, "--val-rows", min=1, show_default=False,
                                            help="Val sequences (default: 16 batches)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier stand-in."),
    ) -> None:
        """Write stand-in data of a config's shape (shards + tokenizer) so `apr train plan` runs on a
        fresh clone. Not text: do not train on it. Exit 0 ok, 1 error."""
        from apr.data.standin import synth_like

        check_output_folder(out, inputs=[like], option="--out")
        t0 = time.monotonic()
        s = synth_like(like, out, train_rows=train_rows, val_rows=val_rows, overwrite=overwrite)
        typer.echo(f"wrote a stand-in for {like} under {s.out} in {time.monotonic() - t0:.1f} s:")
        typer.echo(f"  train      {s.train}  {s.train_rows:,} sequences x {s.row_len:,} tokens")
        if s.val is not None:
            typer.echo(f"  val        {s.val}  {s.val_rows:,} sequences x {s.row_len:,} tokens")
        if s.tokenizer is not None:
            typer.echo(f"  tokenizer  {s.tokenizer}  {s.vocab_size:,} tokens")
        typer.echo(f"plan it from that folder: cd {s.out} && apr train plan {Path(like).resolve()}")
