"""A resumable, deterministic loader over pretokenized shards.

Shards are memory-mapped (Arrow IPC via pyarrow's memory_map) and viewed as one
``[num_rows, seq_len + 1]`` uint32 array; nothing is copied into Python lists. Each epoch uses a
permutation drawn from (seed, epoch). A global micro-batch is ``batch_size * world_size`` rows;
rank r takes rows [r*batch_size, (r+1)*batch_size) of it, so ranks are disjoint. An epoch holds
``steps_per_epoch * gradient_accumulation`` micro-batches; the remainder rows are dropped, exactly
as the plan's step algebra counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from apr.data.shards import shard_files
from apr.errors import AprError, Finding


def _load_rows(path: Path, seq_len: int, column: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = shard_files(path)
    if not files:
        raise AprError(f"no Parquet shards under {path}", [Finding(
            "error", "data.missing", "no .parquet files found", file=str(path), expected="pretokenized shards")])
    arrays = []
    for f in files:
        try:
            table = pq.read_table(f, columns=[column], memory_map=True)
        except Exception as e:
            raise AprError(f"cannot read shard {f}", [Finding(
                "error", "data.shard", str(e).splitlines()[0][:200], file=str(f), path=column)]) from None
        col = table.column(column).combine_chunks()
        if not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
            raise AprError(f"{f}: column {column!r} is {col.type}", [Finding(
                "error", "data.column_type", f"column {column!r} has type {col.type}", file=str(f), path=column,
                expected="list<uint32>", got=str(col.type))])
        if len(col) == 0:
            continue
        values = col.flatten().to_numpy(zero_copy_only=False)
        width = seq_len + 1
        if values.size != len(col) * width:
            raise AprError(f"{f}: rows are not seq_len + 1 = {width} tokens", [Finding(
                "error", "data.row_length", "row length does not match data.seq_len + 1", file=str(f),
                path="data.seq_len", expected=f"{width} tokens per row", got=f"{values.size / len(col):g} on average")])
        arrays.append(values.astype(np.uint32, copy=False).reshape(len(col), width))
    if not arrays:
        raise AprError(f"the shards under {path} hold no rows", [Finding("error", "data.empty", "no rows",
                                                                            file=str(path))])
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


class ShardLoader:
    def __init__(self, path, *, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 gradient_accumulation: int = 1, shuffle: bool = True, input_column: str = "input_ids"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.path = Path(path)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size, self.gradient_accumulation = rank, world_size, gradient_accumulation
        self.shuffle = shuffle
        self._rows = _load_rows(self.path, seq_len, input_column)
        self.num_rows = int(self._rows.shape[0])
        self.steps_per_epoch = self.num_rows // (batch_size * gradient_accumulation * world_size)
        self.micro_batches_per_epoch = self.steps_per_epoch * gradient_accumulation
        self.epoch = 0
        self.position = 0  # micro-batches consumed in the current epoch
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = (np.random.default_rng([self.seed, self.epoch]).permutation(self.num_rows)
                          if self.shuffle else np.arange(self.num_rows))
        return self._perm

    def next_batch(self):
        """The next ``[batch_size, seq_len + 1]`` int64 tensor of this rank; rolls into the next epoch."""
        import torch

        if self.micro_batches_per_epoch == 0:
            raise AprError(f"{self.path}: {self.num_rows} rows are fewer than one optimizer step needs", [Finding(
                "error", "data.too_small", "not enough rows for one step", file=str(self.path),
                expected=f"at least {self.batch_size * self.gradient_accumulation * self.world_size} rows",
                got=str(self.num_rows))])
        if self.position >= self.micro_batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._perm = None
        g = self.batch_size * self.world_size
        start = self.position * g + self.rank * self.batch_size
        idx = self._permutation()[start:start + self.batch_size]
        self.position += 1
        return torch.from_numpy(self._rows[idx].astype(np.int64))

    def iter_sequential(self, max_batches: int | None = None):
        """Fixed-order batches for validation (this rank's share); does not touch the cursor."""
        import torch

        g = self.batch_size * self.world_size
        n = self.num_rows // g
        if max_batches is not None:
            n = min(n, max_batches)
        for b in range(n):
            start = b * g + self.rank * self.batch_size
            yield torch.from_numpy(self._rows[start:start + self.batch_size].astype(np.int64))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows,
                "batch_size": self.batch_size, "world_size": self.world_size,
                "gradient_accumulation": self.gradient_accumulation, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_rows", "batch_size", "world_size", "gradient_accumulation", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise AprError(f"data cursor does not match this dataset: {key} was {state[key]}, "
                               f"now {getattr(self, key)}", [Finding(
                                   "error", "data.cursor", f"saved {key} differs", path=key,
                                   expected=str(getattr(self, key)), got=str(state[key]))])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._perm = None
