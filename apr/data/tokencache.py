"""The token cache: the shards' token columns decoded once into one flat little-endian uint32 file,
memory-mapped from then on, and verified before any of it is trained on.

An entry is three files in the cache folder (``$APR_HOME/cache/tokens``), named by a key over the
source path, the column, the row length and each shard's path, size, mtime and content digest
(``apr.readers.content_digest``: all of a small shard, head, Parquet footer and samples of a large
one):

* ``KEY.u32``: the rows, ``rows * row_len`` uint32 values;
* ``KEY.sum``: one 16-byte BLAKE2b digest per ``BLOCK_BYTES`` block of ``KEY.u32``, written when the
  entry is built;
* ``KEY.json``: what the entry holds (source, column, row length, rows, shards, block size).

**Verification.** Hashing a multi-GB file at open would cost seconds (BLAKE2b runs at about
0.7-1 GB/s on one core here), so each block is checked the first time a batch touches it, before
its rows are used: the cost is one pass over the bytes a run actually reads, spread over its
first steps. A block whose digest differs (zeros written over it, random bytes, a torn copy), a
``.u32`` of the wrong size or a missing/short ``.sum`` means the entry is rebuilt from the shards
(the shards are the truth) with a warning, and the batch is read again from the new entry: a run
never trains on a block that failed its check. A block already checked in this process is not
checked again (a change made to the file during the run after that is not seen).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from apr.errors import AprError
from apr.readers import content_digest, load_json

BLOCK_BYTES = 4 * 2**20
DIGEST_BYTES = 16
Decode = Callable[[Path, int], np.ndarray]  # (shard, rows) -> [rows, row_len] uint32


def _block_digests(data: np.ndarray) -> bytes:
    """One BLAKE2b digest per BLOCK_BYTES of ``data``'s bytes (the last block may be shorter)."""
    raw = memoryview(data.reshape(-1).view(np.uint8))
    return b"".join(hashlib.blake2b(raw[i:i + BLOCK_BYTES], digest_size=DIGEST_BYTES).digest()
                    for i in range(0, len(raw), BLOCK_BYTES))


class TokenCache:
    """One dataset's cache entry: ``rows`` is the memory-mapped ``[rows, row_len]`` array; call
    ``check(indices)`` before reading rows ``indices`` from it (it may rebuild and remap ``rows``)."""

    def __init__(self, source: Path, shards: list[Path], counts: list[int], column: str, row_len: int,
                 cache_dir: Path, decode: Decode, warn: Callable[[str], None]):
        self.source, self.shards, self.counts = os.path.realpath(source), shards, counts
        self.column, self.row_len, self.cache_dir = column, row_len, cache_dir
        self.decode, self.warn = decode, warn
        ident = [self.source, column, row_len] + [
            (os.path.realpath(f), f.stat().st_size, f.stat().st_mtime_ns, content_digest(f)) for f in shards]
        self.key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]
        self.data = cache_dir / f"{self.key}.u32"
        self.sums = cache_dir / f"{self.key}.sum"
        self.num_rows = sum(counts)
        self.nbytes = self.num_rows * row_len * 4
        self.num_blocks = -(-self.nbytes // BLOCK_BYTES)
        self.row_bytes = row_len * 4
        self._open()

    # ------------------------------------------------------------------------------ entry

    def _entry_problem(self) -> str | None:
        """Why the entry on disk cannot be used as it is, or None."""
        if not self.data.is_file():
            return "missing"
        size = self.data.stat().st_size
        if size != self.nbytes:
            return f"{self.data} is {size:,} bytes, {self.nbytes:,} expected (truncated or overwritten)"
        if not self.sums.is_file() or self.sums.stat().st_size != self.num_blocks * DIGEST_BYTES:
            return f"{self.sums} (its block checksums) is missing or incomplete"
        return None

    def _open(self) -> None:
        problem = self._entry_problem()
        if problem is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with _Lock(self.cache_dir / f"{self.key}.lock"):  # ranks on one machine decode the shards once
                problem = self._entry_problem()
                if problem is not None:
                    if problem != "missing":
                        self.warn(f"token cache: {problem}; rebuilding it from the shards under {self.source}")
                    self._build()
        self._map()

    def _map(self) -> None:
        self.rows = np.memmap(self.data, dtype="<u4", mode="r", shape=(self.num_rows, self.row_len))
        expected = np.frombuffer(self.sums.read_bytes(), dtype=np.uint8)
        self.expected = expected.reshape(self.num_blocks, DIGEST_BYTES) if self.num_blocks else expected
        self.checked = np.zeros(self.num_blocks, dtype=bool)
        self.unchecked = self.num_blocks
        self.inode = os.stat(self.data).st_ino

    def _build(self) -> None:
        tmp = self.data.with_name(f".{self.data.name}.{os.getpid()}.tmp")
        tmp_sums = self.sums.with_name(f".{self.sums.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                for shard, n in zip(self.shards, self.counts, strict=True):
                    if n:
                        self.decode(shard, n).astype("<u4", copy=False).tofile(f)
            written = np.memmap(tmp, dtype=np.uint8, mode="r") if self.nbytes else np.zeros(0, np.uint8)
            tmp_sums.write_bytes(_block_digests(written))
            del written
            os.replace(tmp_sums, self.sums)  # the checksums first: a torn pair fails the check, never passes it
            os.replace(tmp, self.data)
        finally:
            for leftover in (tmp, tmp_sums):
                if leftover.exists():
                    leftover.unlink()
        _prune(self.cache_dir, self.source, self.key)
        (self.cache_dir / f"{self.key}.json").write_text(json.dumps(
            {"source": self.source, "column": self.column, "row_len": self.row_len, "rows": self.num_rows,
             "shards": [str(f) for f in self.shards], "block_bytes": BLOCK_BYTES}) + "\n")

    # ------------------------------------------------------------------------------ verification

    def _blocks_of(self, indices: np.ndarray) -> np.ndarray:
        first = indices.astype(np.int64) * self.row_bytes // BLOCK_BYTES
        last = ((indices.astype(np.int64) + 1) * self.row_bytes - 1) // BLOCK_BYTES
        if self.row_bytes <= BLOCK_BYTES:  # a row spans at most two blocks
            return np.unique(np.concatenate([first, last]))
        return np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last, strict=True)]))

    def _block_ok(self, block: int) -> bool:
        raw = memoryview(self.rows.reshape(-1).view(np.uint8))[block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES]
        return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest() == self.expected[block].tobytes()

    def check(self, indices: np.ndarray) -> None:
        """Verify the blocks holding rows ``indices`` that this process has not checked yet; on a
        mismatch rebuild the entry from the shards (once), remap, and check again."""
        if self.unchecked == 0 or indices.size == 0:
            return
        for attempt in range(2):
            blocks = self._blocks_of(indices)
            todo = blocks[~self.checked[blocks]]
            bad = next((int(b) for b in todo if not self._block_ok(int(b))), None)
            if bad is None:
                self.checked[todo] = True
                self.unchecked -= len(todo)
                return
            if attempt:
                break
            self._rebuild(bad)
        raise AprError(f"the token cache {self.data} fails its checksum right after being rebuilt from the "
                       f"shards (block {bad}); is the disk or memory faulty? Run with the cache folder "
                       "elsewhere ($APR_HOME) or remove it", [])

    def _rebuild(self, bad: int) -> None:
        lo, hi = bad * BLOCK_BYTES, min((bad + 1) * BLOCK_BYTES, self.nbytes)
        self.warn(f"token cache: {self.data} bytes {lo:,}-{hi:,} do not match the checksum recorded when it "
                  f"was built (changed or damaged since); rebuilding it from the shards under {self.source}")
        with _Lock(self.cache_dir / f"{self.key}.lock"):
            try:
                rebuilt = os.stat(self.data).st_ino != self.inode and self._entry_problem() is None
            except OSError:
                rebuilt = False
            if not rebuilt:  # another rank on this machine may have rebuilt it already: then just remap
                self._build()
        self._map()


def _prune(cache_dir: Path, source: str, keep: str) -> None:
    """Drop the cache entries of earlier versions of the same dataset."""
    for meta in cache_dir.glob("*.json"):
        if meta.stem == keep:
            continue
        try:  # bounded: a FIFO or junk among the cache's files is skipped, never read or trusted
            doc = load_json(meta, "manifest", "token-cache metadata")
        except AprError:
            continue
        if not isinstance(doc, dict) or doc.get("source") != source:
            continue
        for suffix in (".u32", ".sum", ".lock", ".json"):
            try:
                (cache_dir / f"{meta.stem}{suffix}").unlink()
            except OSError:
                pass


class _Lock:
    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # not POSIX: ranks may each decode the shards; the rename keeps the file whole
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
        return False
