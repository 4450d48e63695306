"""A stand-in dataset of a config's shape: `apr data synth --like CONFIG --out DIR`.

The reference configs (the 350M one above all) name corpora that are not in the repository. To
plan such a config end to end on a fresh clone, this writes, under ``DIR`` and at the config's own
relative paths, a tokenizer with the config's vocabulary size and train/val shards of the right
row length, token type and largest token id, with enough rows for the config's steps. The rows are
cheap (one row repeated; the plan reads only Parquet footers), so a 350M layout takes seconds and
a few megabytes. Training on it teaches nothing: it exists so that `plan` has something to read.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from apr.data.shards import SHARD_PATTERN, write_shard
from apr.errors import AprError, Finding
from apr.steps.algebra import sequences_per_step

VAL_STEPS = 16  # val rows = 16 steps' worth, enough for the default evaluation


@dataclass
class StandIn:
    out: Path
    train: Path
    val: Path | None
    tokenizer: Path | None
    train_rows: int
    val_rows: int
    row_len: int
    vocab_size: int


def write_tokenizer(path: Path, vocab_size: int, added_tokens: int = 0) -> Path:
    """A word-level tokenizer.json with ``vocab_size`` entries (id 0 is ``<|endoftext|>``), plus
    ``added_tokens`` special tokens."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    if added_tokens:
        tok.add_special_tokens([AddedToken(f"<extra_{i}>", special=True) for i in range(added_tokens)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _under(out: Path, configured: str, key: str) -> Path:
    rel = Path(os.path.expanduser(configured))
    if rel.is_absolute():
        raise AprError(f"{key} is an absolute path ({configured}); a stand-in is written under --out at the "
                       "config's relative paths", [Finding("error", "data.standin_path", "absolute path",
                                                           path=key, expected="a relative path", got=configured)])
    target = (out / rel).resolve()
    if not target.is_relative_to(out.resolve()):
        raise AprError(f"{key} ({configured}) leads outside --out", [Finding(
            "error", "data.standin_path", "path leads outside --out", path=key, got=configured)])
    return target


def _write_split(folder: Path, rows: int, row_len: int, vocab_size: int, shard_rows: int, column: str) -> None:

    folder.mkdir(parents=True, exist_ok=True)
    row = (np.arange(row_len, dtype=np.int64) * 7919 % vocab_size).astype(np.uint32)
    row[0] = vocab_size - 1  # the largest id the tokenizer can emit, as real data would have
    for i, start in enumerate(range(0, rows, shard_rows)):
        n = min(shard_rows, rows - start)
        write_shard(folder / SHARD_PATTERN.format(i), np.broadcast_to(row, (n, row_len)), column)


def synth_like(config_path: str | Path, out: str | Path, *, train_rows: int | None = None,
               val_rows: int | None = None, shard_rows: int = 4096, overwrite: bool = False) -> StandIn:
    """Write the stand-in of ``config_path``'s data under ``out``. ``train_rows`` defaults to what
    the config's run consumes (its steps x sequences per step, at least one epoch's worth)."""
    from apr.config import load_config

    config = load_config(config_path).config
    out = Path(out)
    data, arch, tr = config.data, config.model.architecture, config.training
    per_step = sequences_per_step(data.batch_size, tr.gradient_accumulation, tr.world_size)
    if train_rows is None:
        steps = tr.max_steps if tr.max_steps else 1000
        train_rows = per_step * math.ceil(steps / max(tr.epochs, 1))
    if val_rows is None:
        val_rows = data.batch_size * VAL_STEPS
    trains = [_under(out, str(path), key) for key, path in data.train_paths()]
    vals = [_under(out, str(path), key) for key, path in data.val_paths()]
    train, val = trains[0], (vals[0] if vals else None)
    tokenizer = _under(out, str(data.tokenizer), "data.tokenizer") if data.tokenizer else None
    targets = [p for p in (*trains, *vals, tokenizer) if p is not None]
    existing = [p for p in targets if p.exists()]
    if existing and not overwrite:
        raise AprError(f"{existing[0]} already exists; pass --overwrite to replace the stand-in",
                       [Finding("error", "output.refused", "output exists", file=str(existing[0]),
                                expected="a new path, or --overwrite", got="an existing path")])
    for p in existing:
        _remove_earlier_standin(p)
    row_len = data.seq_len + 1
    for folder in trains:  # a mixture: every source as large as the run (no source runs out)
        _write_split(folder, train_rows, row_len, arch.vocab_size, shard_rows, data.input_column)
    for folder in vals:
        _write_split(folder, val_rows, row_len, arch.vocab_size, shard_rows, data.input_column)
    if tokenizer is not None:
        write_tokenizer(tokenizer, arch.vocab_size)
    (out / "STANDIN.txt").write_text(
        f"Stand-in data written by `apr data synth --like {config_path}`: the shapes of that config's\n"
        "data (row length, token ids, vocabulary), not real text. Plan against it; do not train on it.\n")
    return StandIn(out, train, val, tokenizer, train_rows, val_rows if val else 0, row_len, arch.vocab_size)


def _remove_earlier_standin(path: Path) -> None:
    """With --overwrite: replace only what a stand-in holds (shards, a tokenizer.json)."""
    if path.is_file() and path.suffix == ".json":
        path.unlink()
    elif path.is_dir() and all(p.is_file() and p.suffix == ".parquet" for p in path.iterdir()):
        shutil.rmtree(path)
    else:
        raise AprError(f"{path} holds files a stand-in did not write; not replacing it", [Finding(
            "error", "output.refused", "not a stand-in", file=str(path),
            expected="shards and a tokenizer.json written by apr data synth", got="other files")])
