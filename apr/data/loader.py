"""A resumable, deterministic loader over pretokenized shards.

**Memory-mapping.** Parquet pages are compressed, so their values cannot be used in place. The
first time a dataset is opened its shards' token columns are decoded once into one flat
little-endian uint32 file in a cache folder (``$APR_HOME/cache/tokens``, default
``~/.apr/cache/tokens``), keyed by the shards' paths, sizes, modification times and content
digests, and from then on that file is memory-mapped: opening is instant, the operating system
pages rows in and out, and data-parallel ranks on one machine share one copy in the page cache.
Each block of the file is checked against a checksum recorded when it was built before its rows
are first used; a mismatch rebuilds it from the shards with a warning (``apr/data/tokencache.py``). With
``cache_dir=False``, or when the cache folder cannot be written, the shards are decoded into
process memory instead (4 bytes per token).

**Order.** Epoch ``e`` visits the rows in the order of a permutation drawn from
``numpy.random.default_rng([seed, e])`` (identity when ``shuffle`` is off). A global
micro-batch is ``batch_size * world_size`` consecutive entries of that order; rank ``r`` takes
entries ``[r * batch_size, (r + 1) * batch_size)`` of it, so ranks are disjoint and together
cover every row used. An epoch holds ``steps_per_epoch * gradient_accumulation`` micro-batches,
``steps_per_epoch`` from ``apr.steps.algebra.step_count``, the plan's own formula; the rows left
over are not used that epoch (a new permutation picks different ones next epoch).

**Cursor.** ``(epoch, position)``, position counting micro-batches taken in the epoch, is the
whole state: the same on every rank. ``state_dict()`` saved with a checkpoint and
``load_state_dict()`` on a fresh loader continue with exactly the batches an uninterrupted loader
would have given.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from apr.data.shards import shard_files, shard_problem
from apr.data.tokencache import TokenCache
from apr.errors import AprError, Finding
from apr.steps.algebra import step_count

STATE_VERSION = 1
IGNORE = -100  # a target that adds no loss (apr/train/losses.py IGNORE, the kernels' ignore_index)


def default_cache_dir() -> Path:
    home = os.environ.get("APR_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".apr") / "cache" / "tokens"


def _shard_error(shard: Path, message: str, **kw) -> AprError:
    return AprError(f"{shard}: {message}", [Finding("error", kw.pop("code", "data.shard"), message,
                                                    file=str(shard), **kw)])


def check_shard(path: Path, column: str, width: int, key: str = "data.input_column") -> int:
    """Rows of one shard, from its footer; AprError when it is not a shard of this seq_len (``key``:
    the config key that names ``column``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    problem = shard_problem(path)
    if problem is not None:
        raise _shard_error(path, problem, code="data.shard", expected="a Parquet shard (a regular file)")
    try:
        md = pq.read_metadata(path)
    except Exception as e:
        raise _shard_error(path, f"not a readable Parquet file: {(str(e).splitlines() or [''])[0][:200]}",
                           expected="a Parquet shard") from None
    schema = md.schema.to_arrow_schema()
    if column not in schema.names:
        raise _shard_error(path, f"no column {column!r}", code="data.column", path=key,
                           expected=f"column {column!r}", got=", ".join(schema.names[:12]))
    kind = schema.field(column).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
            or not pa.types.is_integer(kind.value_type):
        raise _shard_error(path, f"column {column!r} is {kind}", code="data.column_type", path=key,
                           expected="list<uint32>" if key == "data.input_column" else "list<int32>", got=str(kind))
    if md.num_rows == 0:
        return 0
    leaf = next(j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] == column)
    values = sum(md.row_group(r).column(leaf).num_values for r in range(md.num_row_groups))
    if values != md.num_rows * width:
        raise _shard_error(path, f"rows are not seq_len + 1 = {width} tokens long", code="data.row_length",
                           path="data.seq_len", expected=f"{width} tokens per row",
                           got=f"{values / md.num_rows:g} on average")
    return md.num_rows


def _decode(path: Path, column: str, width: int, rows: int) -> np.ndarray:
    """The shard's tokens as a ``[rows, width]`` uint32 array in memory."""
    values = _values(path, column, width, rows)
    if values.dtype.kind == "i" and values.size and values.min() < 0:  # a signed column: uint32 would wrap
        first = int(np.argmax(values < 0))
        raise _shard_error(path, f"row {first // width} holds the negative token id {int(values[first])}",
                           code="data.token_id", expected="token ids >= 0",
                           got=f"{int(values[first])} at row {first // width}, position {first % width}")
    if values.dtype.itemsize > 4 and values.size and values.max() >= 2**32:
        first = int(np.argmax(values >= 2**32))
        raise _shard_error(path, f"row {first // width} holds the token id {int(values[first])}, beyond uint32",
                           code="data.token_id", expected="token ids < 2**32",
                           got=f"{int(values[first])} at row {first // width}, position {first % width}")
    return values.astype(np.uint32, copy=False).reshape(rows, width)


def _decode_targets(path: Path, column: str, width: int, rows: int, vocab_size: int | None) -> np.ndarray:
    """The shard's custom targets (``training.custom``) as a ``[rows, width]`` int32 array: each a token
    id below ``vocab_size`` or ``IGNORE``."""
    values = _values(path, column, width, rows).astype(np.int64)
    bad = (values != IGNORE) & ((values < 0) | (values >= (vocab_size if vocab_size is not None else 2**31)))
    if bad.any():
        first = int(np.argmax(bad))
        raise _shard_error(path, f"row {first // width} of column {column!r} holds the target {int(values[first])}",
                           code="data.target", path="training.custom.targets_column",
                           expected=f"{IGNORE} or a token id below model.architecture.vocab_size ({vocab_size})",
                           got=f"{int(values[first])} at row {first // width}, position {first % width}")
    return values.astype(np.int32).reshape(rows, width)


def _values(path: Path, column: str, width: int, rows: int) -> np.ndarray:
    """The shard's ``column`` flattened, every row ``width`` long."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=[column], memory_map=True)
    except Exception as e:
        raise _shard_error(path, f"cannot read: {(str(e).splitlines() or [''])[0][:200]}") from None
    lists = table.column(column).combine_chunks()
    if hasattr(lists, "offsets") and len(lists):  # list/large_list: every row must hold `width` tokens
        lengths = np.diff(lists.offsets.to_numpy(zero_copy_only=False))
        if (lengths != width).any():  # ragged rows whose lengths average out pass the footer check
            first = int(np.argmax(lengths != width))
            raise _shard_error(path, f"row {first} holds {int(lengths[first])} tokens, not seq_len + 1 = {width}",
                               code="data.row_length", path="data.seq_len", expected=f"{width} tokens per row",
                               got=f"{int(lengths[first])} at row {first}")
    values = lists.flatten().to_numpy(zero_copy_only=False)
    if values.size != rows * width:
        raise _shard_error(path, f"holds {values.size} tokens, its footer says {rows * width}")
    return values


class TokenCacheWarning(UserWarning):
    """The token cache did not match its checksums and was rebuilt from the shards."""


class ShardLoader:
    """Batches of ``[batch_size, seq_len + 1]`` int64 CPU tensors from a folder of shards (or one shard).
    With ``targets_column`` (``training.mode: custom``), ``[batch_size, 2 (seq_len + 1)]``: each row's
    ids, then its targets from that column (decoded into process memory, 4 bytes a target)."""

    def __init__(self, path, *, seq_len: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 gradient_accumulation: int = 1, shuffle: bool = True, input_column: str = "input_ids",
                 cache_dir: str | Path | bool | None = None, vocab_size: int | None = None,
                 on_warning: Callable[[str], None] | None = None, targets_column: str | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if batch_size < 1 or gradient_accumulation < 1 or seq_len < 1:
            raise ValueError("seq_len, batch_size and gradient_accumulation must be at least 1")
        self.path = Path(path)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size, self.gradient_accumulation = rank, world_size, gradient_accumulation
        self.shuffle, self.input_column = shuffle, input_column
        # with vocab_size, every batch's ids are checked (one max per batch): the plan cannot see
        # them in shards written without Parquet statistics (contract C-DATA-007)
        self.vocab_size = vocab_size
        self.shards = shard_files(self.path)
        if not self.shards:
            raise AprError(f"no Parquet shards under {self.path}", [Finding(
                "error", "data.missing", "no .parquet files found", file=str(self.path),
                expected="a folder of pretokenized shards (apr data pretokenize)")])
        width = seq_len + 1
        counts = [check_shard(f, input_column, width) for f in self.shards]
        self._shard_ends = np.cumsum(counts)
        if sum(counts) == 0:
            raise AprError(f"the shards under {self.path} hold no rows", [Finding(
                "error", "data.empty", "no rows", file=str(self.path), expected="at least one row", got="0")])
        if cache_dir is None or cache_dir is True:
            cache_dir = default_cache_dir()
        self._rows: np.ndarray | None = None
        self._cache: TokenCache | None = None
        warn = on_warning or (lambda message: warnings.warn(message, TokenCacheWarning, stacklevel=3))
        if cache_dir is not False:
            try:
                self._cache = TokenCache(self.path, self.shards, counts, input_column, width, Path(cache_dir),
                                         decode=lambda shard, n: _decode(shard, input_column, width, n), warn=warn)
                self._rows = self._cache.rows
            except OSError:  # a read-only or full cache folder: fall back to memory
                self._cache = None
        self.memory_mapped = self._cache is not None
        if self._rows is None:
            arrays = [_decode(f, input_column, width, n) for f, n in zip(self.shards, counts, strict=True) if n]
            self._rows = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        self.num_rows = int(len(self._rows))
        self._targets: np.ndarray | None = None
        if targets_column is not None:
            key = "training.custom.targets_column"
            parts = [_decode_targets(f, targets_column, width, check_shard(f, targets_column, width, key), vocab_size)
                     for f in self.shards]
            self._targets = parts[0] if len(parts) == 1 else np.concatenate(parts)
        count = step_count(num_sequences=self.num_rows, batch_size=batch_size,
                           gradient_accumulation=gradient_accumulation, world_size=world_size)
        self.sequences_per_step, self.steps_per_epoch = count.sequences_per_step, count.steps_per_epoch
        self.micro_batches_per_epoch = self.steps_per_epoch * gradient_accumulation
        self.epoch = 0
        self.position = 0  # micro-batches taken in the current epoch, counted globally (same on every rank)
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    # ------------------------------------------------------------------------------ rows

    def _gather(self, indices: np.ndarray):
        """Rows by index as one int64 tensor (a copy: the cache stays read-only)."""
        import torch

        if self._cache is not None:
            self._cache.check(indices)  # may rebuild the cache from the shards and remap it
            self._rows = self._cache.rows
        rows = self._rows[indices]
        if self.vocab_size is not None and rows.size and int(rows.max()) >= self.vocab_size:
            self._bad_id(indices, rows)
        if self._targets is not None:  # the custom objective's: beside the ids
            rows = np.concatenate([rows.astype(np.int64), self._targets[indices].astype(np.int64)], axis=1)
        return torch.from_numpy(rows.astype(np.int64))

    def _bad_id(self, indices: np.ndarray, rows: np.ndarray):
        """Raise the error naming the shard, row and position of the first id >= vocab_size in ``rows``."""
        at = int(np.argmax((rows >= self.vocab_size).any(axis=1)))
        pos = int(np.argmax(rows[at] >= self.vocab_size))
        index = int(indices[at])
        shard = int(np.searchsorted(self._shard_ends, index, side="right"))
        row = index - (int(self._shard_ends[shard - 1]) if shard else 0)
        token = int(rows[at, pos])
        raise _shard_error(self.shards[shard], f"row {row} holds token id {token}, not below vocab_size "
                                               f"{self.vocab_size} (were the shards made with another tokenizer?)",
                           code="data.token_id", path="model.architecture.vocab_size",
                           expected=f"token ids < {self.vocab_size}", got=f"{token} at row {row}, position {pos}")

    def _order(self, epoch: int | None = None) -> np.ndarray:
        epoch = self.epoch if epoch is None else epoch
        if self._perm_epoch != epoch:
            # numpy seeds must be non-negative; a negative config seed maps to its 64-bit pattern
            self._perm = (np.random.default_rng([self.seed % 2**64, epoch]).permutation(self.num_rows)
                          if self.shuffle else np.arange(self.num_rows))
            self._perm_epoch = epoch
        return self._perm

    # ------------------------------------------------------------------------ the cursor as one number

    @property
    def absolute(self) -> int:
        """Micro-batches drawn since the start of the run (every epoch), counted globally."""
        return self.epoch * self.micro_batches_per_epoch + self.position

    def seek(self, absolute: int) -> None:
        """Put the cursor at micro-batch ``absolute`` of the run (see ``absolute``)."""
        self.epoch, self.position = divmod(int(absolute), self.micro_batches_per_epoch)

    def rows_at(self, absolute: int) -> list[int]:
        """The rows (indices into the concatenated shards) of global micro-batch ``absolute``, every
        rank's part, in rank order."""
        epoch, position = divmod(int(absolute), self.micro_batches_per_epoch)
        g = self.batch_size * self.world_size
        return [int(i) for i in self._order(epoch)[position * g:(position + 1) * g]]

    def locate(self, index: int) -> tuple[str, int]:
        """(shard file relative to the data folder, row within that shard) of row ``index`` of the
        concatenated shards."""
        shard = int(np.searchsorted(self._shard_ends, index, side="right"))
        path = self.shards[shard]
        name = path.relative_to(self.path).as_posix() if self.path.is_dir() else path.name
        return name, int(index) - (int(self._shard_ends[shard - 1]) if shard else 0)

    def sample_read_and_ahead(self, rows: int, rng) -> tuple[np.ndarray, np.ndarray] | None:
        """Up to ``rows`` rows (uint32 ``[n, seq_len + 1]``) drawn at random (``rng``, a numpy
        Generator) from the rows this epoch has given out so far, every rank's, and as many from the
        rows it has still to give; None at an epoch's start or end, where one side is empty. For the
        drift between them during training (apr/train/datadrift.py): read straight from the cache, not
        checked against its checksums (a statistic, not a batch)."""
        g = self.batch_size * self.world_size
        done, end = self.position * g, self.micro_batches_per_epoch * g
        if done == 0 or done >= end:
            return None
        order = self._order()
        read = order[rng.choice(done, size=min(rows, done), replace=False)]
        ahead = order[done + rng.choice(end - done, size=min(rows, end - done), replace=False)]
        return self._rows[np.sort(read)], self._rows[np.sort(ahead)]

    # ------------------------------------------------------------------------------ API

    def next_batch(self):
        """This rank's next ``[batch_size, seq_len + 1]`` int64 tensor; rolls into the next epoch."""
        if self.micro_batches_per_epoch == 0:
            need = self.sequences_per_step
            raise AprError(f"{self.path}: {self.num_rows} rows are fewer than one optimizer step needs", [Finding(
                "error", "data.too_small", "not enough rows for one step", file=str(self.path),
                expected=f"at least {need} rows (batch_size x gradient_accumulation x world_size)",
                got=str(self.num_rows))])
        if self.position >= self.micro_batches_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size * self.world_size + self.rank * self.batch_size
        indices = self._order()[start:start + self.batch_size]
        self.position += 1
        return self._gather(indices)

    def iter_sequential(self, max_batches: int | None = None, keep_tail: bool = False):
        """This rank's share of the rows in stored order, whole batches only (for validation); the
        cursor is not touched, so evaluating never changes the training batches. ``keep_tail``
        (one process only) adds the rows after the last whole batch as a smaller last batch."""
        g = self.batch_size * self.world_size
        n = self.num_rows // g
        if max_batches is not None:
            n = min(n, max_batches)
        for b in range(n):
            start = b * g + self.rank * self.batch_size
            yield self._gather(np.arange(start, start + self.batch_size))
        if keep_tail and self.world_size == 1 and n * g < self.num_rows and (max_batches is None or n < max_batches):
            yield self._gather(np.arange(n * g, self.num_rows))

    def state_dict(self) -> dict:
        """The cursor plus what it is only valid for; JSON-serialisable."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_rows": self.num_rows, "batch_size": self.batch_size, "world_size": self.world_size,
                "gradient_accumulation": self.gradient_accumulation, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor; AprError when it was saved for other data or another layout."""
        if state.get("kind") == "mixture":
            raise AprError("the saved data cursor is a mixture's (data.train listed sources), this config reads "
                           "one data.train", [Finding("error", "data.cursor", "saved cursor is a mixture's",
                                                      path="data.train", expected="one data.train folder",
                                                      got="a mixture of sources")])
        for key in ("num_rows", "batch_size", "world_size", "gradient_accumulation", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise AprError(f"the saved data cursor does not fit this loader: {key} was {state[key]}, "
                               f"now {getattr(self, key)}", [Finding(
                                   "error", "data.cursor", f"saved {key} differs", path=key,
                                   expected=str(getattr(self, key)), got=str(state[key]))])
        position = int(state["position"])
        if not 0 <= position <= self.micro_batches_per_epoch:
            raise AprError(f"the saved data cursor position {position} is outside the epoch", [Finding(
                "error", "data.cursor", "position out of range", path="position",
                expected=f"0..{self.micro_batches_per_epoch}", got=str(position))])
        self.epoch = int(state["epoch"])
        self.position = position
