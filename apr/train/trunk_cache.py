"""Cached trunk activations (``model.stacking.cache_activations``): the frozen trunk's output
(embedding and earlier blocks) computed once per training row, and the new stack trained on it.

The cache of a stage lives in ``<output_dir>/.apr/trunk-cache/<digest>/``, where the digest is the
SHA-256 of the trunk's tensors (the checkpoint's own bytes), the sequence length and the residual
dtype: a cache of other trunk weights is never read, because it sits in another folder. Each row
is one file named by the SHA-256 of its token ids and the CRC-32 of its contents
(``<row>.<crc>.npy``): written to a temporary name and renamed (a crash leaves no partial file),
read memory-mapped and checked against its CRC (a mismatch is an error naming the file). Rows are
filled as they are first seen, for the whole micro-batch at once, by the same ops as an uncached
step; a resumed run finds the files of the run before it. A full disk stops the cache (the run
goes on without it and says so once). See docs/design.md, "StackWise progressive stacks".
"""

from __future__ import annotations

import errno
import hashlib
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.model.trunk import trunk_state
from apr.steps import stacking


def trunk_digest(tensors: dict[str, torch.Tensor], seq_len: int, dtype: torch.dtype) -> str:
    """What the cache's rows depend on besides the rows: the trunk's tensors, bytes and names."""
    h = hashlib.sha256(f"{seq_len}:{dtype}".encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:32]


class TrunkCache:
    """The trunk output of each row seen, on disk; ``hidden`` is the trunk's forward through it."""

    def __init__(self, root: Path, blocks: int, digest: Callable[[], str], warn: Callable[[str], None]):
        self.root = root
        self.blocks = blocks  # the bottom blocks the cache stands for
        self.digest = digest  # read at first use: a grow or a resume loads the trunk after the build
        self.warn = warn
        self.enabled = True
        self.hits = self.misses = 0
        self.folder: Path | None = None
        self.files: dict[str, Path] = {}

    def _open(self) -> None:
        self.folder = self.root / self.digest()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self._stop(err, self.folder.name)
            return
        for entry in os.scandir(self.folder):
            row, _, rest = entry.name.partition(".")
            if rest.endswith(".npy") and not rest.startswith("tmp"):
                self.files[row] = Path(entry.path)

    def _stop(self, err: OSError, name: str) -> None:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise err
        self.enabled = False
        self.warn(f"the trunk cache stopped: {err.strerror} writing {name} in {self.root}; training goes on "
                  "computing the trunk's output every step")

    @staticmethod
    def row_key(row: torch.Tensor) -> str:
        return hashlib.sha256(row.to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()[:40]

    def _read(self, path: Path) -> np.ndarray:
        data = np.load(path, mmap_mode="r")
        crc = f"{zlib.crc32(memoryview(np.ascontiguousarray(data)).cast('B')):08x}"
        if path.name.split(".")[1] != crc:
            raise AprError(f"{path}: a trunk-cache row whose contents do not match its checksum ({crc}); "
                           f"delete {self.folder} to rebuild the cache")
        return data

    def _write(self, key: str, value: np.ndarray) -> None:
        crc = f"{zlib.crc32(memoryview(np.ascontiguousarray(value)).cast('B')):08x}"
        final = self.folder / f"{key}.{crc}.npy"
        tmp = self.folder / f"{key}.tmp{os.getpid()}.npy"
        try:
            np.save(tmp, value)
            os.replace(tmp, final)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            self._stop(err, final.name)
            return
        self.files[key] = final

    def hidden(self, lm, ids: torch.Tensor, residual_dtype: torch.dtype | None) -> torch.Tensor:
        """The trunk's output for ``ids`` (rows from the cache, or computed for the whole micro-batch
        and stored), then the blocks above it with autograd: what ``lm.hidden_states`` computes."""
        if self.folder is None and self.enabled:
            self._open()
        keys = [self.row_key(r) for r in ids]
        cos, sin = lm.rope(ids.shape[1], ids.device)
        if self.enabled and all(k in self.files for k in keys):
            self.hits += 1
            rows = [torch.from_numpy(np.array(self._read(self.files[k]))) for k in keys]
            x = torch.stack(rows).to(ids.device)
            if residual_dtype is not None:
                x = x.to(residual_dtype)
        else:
            self.misses += 1
            with torch.no_grad():
                x = lm.model.embed_tokens(ids)
                if residual_dtype is not None:
                    x = x.to(residual_dtype)
                for layer in lm.model.layers[:self.blocks]:
                    x = layer(x, cos, sin)
                    if residual_dtype is not None:
                        x = x.to(residual_dtype)
            if self.enabled:
                stored = x.detach().to("cpu", torch.float32).numpy()
                for k, row in zip(keys, stored, strict=True):
                    if k not in self.files and self.enabled:
                        self._write(k, row)
        for layer in lm.model.layers[self.blocks:]:
            x = layer(x, cos, sin)
            if residual_dtype is not None:
                x = x.to(residual_dtype)
        return x


def trunk_cache_for(engine, staged: AprConfig, run_dir: Path, warn: Callable[[str], None]) -> TrunkCache | None:
    """The cache of the stage ``staged`` describes (``model.stacking.cache_activations`` from stage 1
    on), keyed by the engine's trunk as it is at the cache's first use; None without one."""
    blocks = stacking.cached_blocks(staged)
    if not blocks:
        return None
    return TrunkCache(run_dir / ".apr" / "trunk-cache", blocks, warn=warn,
                      digest=lambda: trunk_digest(trunk_state(engine.model, staged), staged.data.seq_len, engine.cdt))
