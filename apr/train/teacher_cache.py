"""The teacher output cache (``training.distill.cache_teacher_outputs``): the teacher's hidden states at
every block boundary phase 1 reads, computed once per training row and memory-mapped from then on.

An entry is four files in ``$APR_HOME/cache/teacher`` (default ``~/.apr/cache/teacher``), named by a
key over the teacher's weights digest (BLAKE2b of every parameter's name, dtype, shape and bytes),
the dtype (float32), the row length, the hidden size, the boundaries and the data-parallel rank:

* ``KEY.f32``: one slot per row, ``boundaries x row_len x hidden`` float32 values;
* ``KEY.sum``: one 16-byte BLAKE2b digest per slot;
* ``KEY.idx``: one 16-byte BLAKE2b digest of the row's token ids per slot (a row is found by what
  it holds, so a cache can never hand a row the states of another);
* ``KEY.json``: what the entry holds, the teacher digest among it.

A slot is appended data first, then its checksum, then its index entry: a torn append (a kill, a full
disk) leaves an index shorter than the data and the slot is ignored. Each slot is checked against its
digest the first time this process reads it; one that fails is never trusted: the batch is computed
by the teacher again and the slot rewritten. An entry whose ``.json`` names another teacher is not
used (it is started afresh). A write that fails (a full disk) turns the cache off for the rest of the
run, which goes on with the teacher computing its states each step, and says so. See
docs/design.md section 33.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from apr.errors import AprError
from apr.readers import is_regular, load_json

DIGEST_BYTES = 16
DTYPE = "float32"


def default_cache_dir() -> Path:
    home = os.environ.get("APR_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".apr") / "cache" / "teacher"


def teacher_digest(teacher: torch.nn.Module) -> str:
    """BLAKE2b over the teacher's parameters (names, dtypes, shapes, bytes), in order."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name, p in teacher.state_dict().items():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
    return h.hexdigest()


def slot_bytes(boundaries: int, row_len: int, hidden: int) -> int:
    """Bytes on disk per cached row (data + checksum + index entry)."""
    return boundaries * row_len * hidden * 4 + 2 * DIGEST_BYTES


def _digest(raw) -> bytes:
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


class TeacherCache:
    """One teacher's cache entry for rows of ``row_len`` tokens: ``get(ids)`` returns the states
    ``[boundaries, rows, row_len, hidden]`` if every row is cached and passes its check, else None;
    ``put(ids, states)`` records them."""

    def __init__(self, folder: Path, digest: str, boundaries: list[int], row_len: int, hidden: int,
                 rank: int, warn: Callable[[str], None]):
        self.boundaries, self.row_len, self.hidden, self.warn = boundaries, row_len, hidden, warn
        self.enabled, self.hits, self.misses = True, 0, 0
        meta = {"teacher": digest, "dtype": DTYPE, "row_len": row_len, "hidden": hidden,
                "boundaries": boundaries, "rank": rank}
        key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]
        self.data, self.sums, self.idx, self.meta = (folder / f"{key}{s}" for s in (".f32", ".sum", ".idx", ".json"))
        self.floats = len(boundaries) * row_len * hidden
        self.nbytes = self.floats * 4
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not self._meta_matches(meta):  # missing, foreign or unreadable: start afresh
                for f in (self.data, self.sums, self.idx):
                    f.unlink(missing_ok=True)
                self.meta.write_text(json.dumps(meta) + "\n")
            for f in (self.data, self.sums, self.idx):
                f.touch()
                if not is_regular(f):  # a FIFO, device or folder put there is never read
                    raise OSError(f"{f} is not a regular file")
            self._load()
        except OSError as e:
            self._off(f"cannot use {folder} ({e.strerror or e})")
            self.count, self.slots = 0, {}

    def _meta_matches(self, meta: dict) -> bool:
        if not self.meta.exists() or not is_regular(self.meta):
            return False
        try:  # bounded: junk is not trusted
            return load_json(self.meta, "manifest", "teacher-cache metadata") == meta
        except AprError:
            return False

    def _load(self) -> None:
        n = min(self.idx.stat().st_size, self.sums.stat().st_size) // DIGEST_BYTES
        n = min(n, self.data.stat().st_size // self.nbytes)
        raw_idx, raw_sums = self.idx.read_bytes(), self.sums.read_bytes()
        self.slots = {raw_idx[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]: i for i in range(n)}
        self.expected = [raw_sums[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] for i in range(n)]
        self.count, self.checked, self.mapped = n, set(), None

    def _off(self, why: str) -> None:
        if self.enabled:
            self.warn(f"teacher cache: {why}; the run goes on without it (the teacher computes its outputs "
                      "every phase-1 step)")
        self.enabled = False

    def _map(self) -> np.ndarray:
        if self.mapped is None or self.mapped.shape[0] < self.count:
            self.mapped = np.memmap(self.data, dtype="<f4", mode="r", shape=(self.count, self.floats))
        return self.mapped

    @staticmethod
    def _row_keys(ids: torch.Tensor) -> list[bytes]:
        rows = ids.detach().cpu().to(torch.int64).numpy()
        return [_digest(memoryview(np.ascontiguousarray(r))) for r in rows]

    def get(self, ids: torch.Tensor) -> torch.Tensor | None:
        if not self.enabled or ids.shape[1] != self.row_len:
            return None
        keys = self._row_keys(ids)
        slots = [self.slots.get(k) for k in keys]
        if any(s is None for s in slots):
            self.misses += 1
            return None
        data = self._map()
        for s in slots:
            if s in self.checked:
                continue
            if _digest(memoryview(data[s])) != self.expected[s]:
                lo = s * self.nbytes
                self.warn(f"teacher cache: {self.data} bytes {lo:,}-{lo + self.nbytes:,} do not match the checksum "
                          "recorded when they were written (changed or damaged since); recomputing them from the "
                          "teacher")
                self.misses += 1
                return None
            self.checked.add(s)
        self.hits += 1
        out = torch.from_numpy(np.stack([data[s] for s in slots]))
        out = out.view(len(slots), len(self.boundaries), self.row_len, self.hidden).transpose(0, 1)
        return out.to(ids.device)

    def put(self, ids: torch.Tensor, states: torch.Tensor) -> None:
        """``states``: ``[boundaries, rows, row_len, hidden]`` float32, the teacher's for ``ids``."""
        if not self.enabled or ids.shape[1] != self.row_len:
            return
        rows = states.detach().transpose(0, 1).contiguous().cpu().numpy().astype("<f4", copy=False)
        try:
            for key, row in zip(self._row_keys(ids), rows, strict=True):
                raw = row.reshape(-1).tobytes()
                slot = self.slots.get(key)
                if slot is not None:  # failed its check (or a row twice in a batch): rewritten in place
                    self._rewrite(slot, raw)
                else:
                    self._append(key, raw)
        except OSError as e:
            self._off(f"writing {self.data} failed ({e.strerror or e})")

    def _rewrite(self, slot: int, raw: bytes) -> None:
        sum_ = _digest(raw)
        with open(self.data, "r+b") as f:
            f.seek(slot * self.nbytes)
            f.write(raw)
        with open(self.sums, "r+b") as f:
            f.seek(slot * DIGEST_BYTES)
            f.write(sum_)
        self.expected[slot] = sum_
        self.checked.discard(slot)
        self.mapped = None

    def _append(self, key: bytes, raw: bytes) -> None:
        slot = self.count
        for path, offset, chunk in ((self.data, slot * self.nbytes, raw),
                                    (self.sums, slot * DIGEST_BYTES, _digest(raw)),
                                    (self.idx, slot * DIGEST_BYTES, key)):  # the index last: a torn append is ignored
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(chunk)
                f.truncate()
        self.expected.append(_digest(raw))
        self.slots[key] = slot
        self.count += 1
