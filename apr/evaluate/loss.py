"""Loss, perplexity and bits per byte of a model over a folder of pretokenized shards.

The loss is computed exactly as the trainer's validation does it (``Engine.eval_loss_sum``): the
same chunked LM-head cross-entropy, summed per batch in float32 and over batches in float64, so
``apr eval`` on a run's val folder with the run's batch size reproduces the val loss the run
recorded with ``--max-batches`` = ``eval_batches`` for one process, and ``eval_batches`` x the world
size under data parallelism (each rank reads its own batches; docs/eval.md); float32 weights (a run
trained in bf16 evaluated in bf16 differs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from apr.errors import AprError, Finding
from apr.kernels import get_backend
from apr.readers import load_json

TEXT_SUFFIXES_NOT_RAW = (".jsonl", ".json", ".parquet")  # sources whose file size is not the text's


@dataclass
class SourceLoss:
    name: str
    path: Path
    rows: int
    tokens: int
    loss: float
    bytes_per_token: float | None  # from the dataset's manifest, when its sources are plain text

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_byte(self) -> float | None:
        if self.bytes_per_token is None:
            return None
        return self.loss / math.log(2) / self.bytes_per_token

    def to_dict(self) -> dict:
        return {"name": self.name, "path": str(self.path), "rows": self.rows, "tokens": self.tokens,
                "loss": self.loss, "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}


def data_sources(folder: str | Path) -> list[tuple[str, Path]]:
    """The sources of ``folder``: each immediate subfolder holding shards when there are several
    (``train/`` and ``val/`` of a pretokenized dataset, or one folder per corpus), else the folder."""
    from apr.data.shards import shard_files

    folder = Path(folder).expanduser()
    if not folder.exists():
        raise AprError(f"{folder}: no such data folder", [Finding(
            "error", "eval.data_missing", "path does not exist", path="--data", file=str(folder),
            expected="a folder of pretokenized Parquet shards")])
    if not shard_files(folder):
        raise AprError(f"no Parquet shards under {folder}", [Finding(
            "error", "eval.data_missing", "no .parquet files found", path="--data", file=str(folder),
            expected="a folder of pretokenized shards (apr data pretokenize)")])
    if folder.is_dir() and not any(p.suffix == ".parquet" for p in folder.iterdir()):
        subs = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and shard_files(p))
        if len(subs) > 1:
            return [(p.name, p) for p in subs]
    return [(folder.name, folder)]


def row_width(path: Path, column: str) -> int:
    """Tokens per row of the first shard under ``path``."""
    import pyarrow.parquet as pq

    from apr.data.shards import shard_files, shard_problem

    for shard in shard_files(path):
        problem = shard_problem(shard)  # a FIFO would hang the Parquet reader
        if problem is not None:
            raise AprError(f"{shard} {problem}", [Finding("error", "eval.data_unreadable", problem, file=str(shard),
                                                          expected="a Parquet shard (a regular file)")])
        try:
            pf = pq.ParquetFile(shard)
            if column not in pf.schema_arrow.names:
                raise AprError(f"{shard} has no column {column!r}", [Finding(
                    "error", "eval.data_column", "column missing", file=str(shard), expected=column,
                    got=", ".join(pf.schema_arrow.names))])
            for batch in pf.iter_batches(batch_size=1, columns=[column]):
                if batch.num_rows:
                    return len(batch.column(0)[0])
        except OSError as err:
            raise AprError(f"{shard} is not a readable Parquet file: {err}", [Finding(
                "error", "eval.data_unreadable", str(err), file=str(shard))]) from None
    raise AprError(f"the shards under {path} hold no rows", [Finding(
        "error", "eval.data_empty", "no rows", file=str(path), expected="at least one row", got="0")])


def bytes_per_token(path: Path) -> float | None:
    """Raw text bytes per token of the dataset ``path`` belongs to (manifest.json in it or its
    parent): the corpus average, known only when every source is a plain text file."""

    for folder in (path, path.parent):
        manifest = folder / "manifest.json"
        if manifest.is_file():
            try:
                doc = load_json(manifest, "manifest", "dataset manifest")
                sources = doc["sources"]
                tokens = int(doc["tokens_total"])
                if not sources or tokens <= 0 or any(
                        str(s["path"]).lower().endswith(TEXT_SUFFIXES_NOT_RAW) for s in sources):
                    return None
                return sum(int(s["bytes"]) for s in sources) / tokens
            except (AprError, ValueError, KeyError, TypeError):
                return None  # no usable manifest: bits per byte unknown
    return None


def eval_loss(loaded, folder: str | Path, *, batch_size: int | None = None, max_batches: int | None = None,
              input_column: str | None = None, chunk_size: int | None = None) -> list[SourceLoss]:
    """Mean next-token loss of ``loaded.model`` over each source of ``folder`` (see ``data_sources``):
    batches of ``batch_size`` rows in stored order, at most ``max_batches`` per source; the rows
    after the last whole batch form a last, smaller batch within that limit."""
    config = loaded.config
    batch_size = batch_size or (config.data.batch_size if config is not None else 8)
    column = input_column or (config.data.input_column if config is not None else "input_ids")
    chunk_size = chunk_size or (config.training.loss_chunk_size if config is not None else 1024)
    return [_source_loss(loaded, name, path, batch_size, max_batches, column, chunk_size)
            for name, path in data_sources(folder)]


def _source_loss(loaded, name: str, path: Path, batch_size: int, max_batches: int | None, column: str,
                 chunk_size: int) -> SourceLoss:
    import torch

    from apr.data.loader import ShardLoader

    width = row_width(path, column)
    seq_len = width - 1
    if seq_len < 1 or seq_len > loaded.context:
        raise AprError(f"{path}: rows hold {width} tokens; the model's context is {loaded.context}", [Finding(
            "error", "eval.seq_len", "rows longer than the model's context", file=str(path),
            expected=f"rows of 2 to {loaded.context + 1} tokens", got=f"{width}")])
    loader = ShardLoader(path, seq_len=seq_len, batch_size=batch_size, shuffle=False, input_column=column,
                         cache_dir=False)
    model, device = loaded.model, loaded.device
    vocab = loaded.arch.vocab_size
    backend = get_backend("torch", device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = rows = 0
    with torch.inference_mode():
        for batch in loader.iter_sequential(max_batches, keep_tail=True):
            top = int(batch.max())
            if top >= vocab:
                raise AprError(f"{path}: token id {top} is outside the model's vocabulary of {vocab}", [Finding(
                    "error", "eval.token_range", "token id out of range", file=str(path),
                    expected=f"ids below {vocab}", got=str(top))])
            batch = batch.to(device)
            ids, targets = batch[:, :-1], batch[:, 1:]
            total += model.loss(model.hidden_states(ids, torch.float32), targets, chunk_size=chunk_size,
                                backend=backend, compute_dtype=torch.float32, total=True).double()
            tokens += targets.numel()
            rows += batch.shape[0]
    return SourceLoss(name=name, path=path, rows=rows, tokens=tokens, loss=float(total.item() / tokens),
                      bytes_per_token=bytes_per_token(path))


def overall(losses: list[SourceLoss]) -> dict:
    """Token-weighted mean over sources."""
    tokens = sum(s.tokens for s in losses)
    loss = sum(s.loss * s.tokens for s in losses) / tokens
    return {"tokens": tokens, "loss": loss, "perplexity": math.exp(min(loss, 700.0))}
