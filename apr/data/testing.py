"""Quick valid shards for tests and benchmarks, without training a tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from apr.data.shards import write_dataset


def make_shards(out: str | Path, n_rows: int, seq_len: int, vocab_size: int, seed: int = 0,
                rows_per_shard: int = 1000, val_rows: int = 0, column: str = "input_ids") -> dict:
    """Write random token rows ([n_rows, seq_len + 1], ids < vocab_size) in the pretokenize layout.

    Rows follow a simple learnable pattern (next token = previous + 1 mod vocab, with noise) so a
    model trained on them shows a falling loss."""
    rng = np.random.default_rng(seed)
    total = n_rows + val_rows
    starts = rng.integers(0, vocab_size, size=(total, 1))
    rows = (starts + np.arange(seq_len + 1)[None, :]) % vocab_size
    noise = rng.random(rows.shape) < 0.1
    rows[noise] = rng.integers(0, vocab_size, size=int(noise.sum()))
    rows = rows.astype(np.uint32)
    splits = {"train": rows[:n_rows]}
    if val_rows:
        splits["val"] = rows[n_rows:]
    manifest = {"seq_len": seq_len, "row_len": seq_len + 1, "vocab_size": vocab_size, "seed": seed,
                "sources": [{"path": "apr.data.testing.make_shards"}]}
    return write_dataset(Path(out), splits, manifest, rows_per_shard, column)
