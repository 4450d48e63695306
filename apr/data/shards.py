"""The shard format and its atomic writer.

A dataset folder holds ``train/shard-NNNNN.parquet``, ``val/shard-NNNNN.parquet`` (when a val
split was asked for) and ``manifest.json``. Each shard is one Parquet file with one column
(``input_ids`` by default) of type ``list<uint32>``; every row holds exactly ``seq_len + 1``
tokens; each shard is one row group, zstd-compressed, with column statistics (min/max token id)
in the footer so ``apr train plan`` reads counts and the largest id without touching data pages.

Everything is written into a hidden temporary folder beside the destination and renamed into
place only when complete, so a crash or an error never leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from apr.errors import AprError, Finding
from apr.fsutil import fsync_dir
from apr.readers import check_regular

SHARD_PATTERN = "shard-{:05d}.parquet"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def write_shard(path: Path, rows: np.ndarray, column: str = "input_ids") -> None:
    """Write ``rows`` (``[n, seq_len + 1]``, uint32) as one Parquet file with column statistics."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = np.ascontiguousarray(rows, dtype=np.uint32)
    n, width = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    values = pa.array(rows.reshape(-1), type=pa.uint32())
    table = pa.table({column: pa.ListArray.from_arrays(offsets, values)})
    pq.write_table(table, path, compression="zstd", write_statistics=True, row_group_size=max(n, 1))


def _io_error(path: Path, e: OSError, what: str = "cannot write") -> AprError:
    return AprError(f"{what} {path}: {e.strerror or e}", [Finding(
        "error", "data.output", f"{what}: {e.strerror or e}", file=str(path))])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_destination(out: Path, overwrite: bool, inputs: list[Path] | tuple[Path, ...] = ()) -> None:
    """Refuse an existing output unless ``overwrite``, and even then unless it is an earlier output
    (a folder with ``manifest.json``); refuse an output that is, or holds, one of the ``inputs``."""
    target = Path(os.path.abspath(out))
    for src in inputs:
        src = Path(os.path.abspath(src))
        if src == target or src.is_relative_to(target):
            raise AprError(f"--out {out} would replace the input {src}", [Finding(
                "error", "data.output", "the output folder is, or contains, an input", file=str(out),
                expected="an --out outside every input", got=str(src))])
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return  # an empty folder (made by hand, or left by an earlier failed call) holds nothing to lose
    if not overwrite:
        raise AprError(f"output {out} already exists", [Finding(
            "error", "data.output", "already exists; choose another --out or pass --overwrite",
            file=str(out), expected="a path that does not exist yet")])
    if out.is_symlink() or not out.is_dir() or not (out / MANIFEST).is_file():
        raise AprError(f"{out} is not an earlier pretokenize output (no {MANIFEST}); --overwrite only replaces "
                       "a folder apr wrote", [Finding(
                           "error", "data.output", "refusing to replace something apr did not write",
                           file=str(out), expected=f"a folder holding {MANIFEST}", got="something else")])


class DatasetWriter:
    """Streams rows into shards of ``shard_rows`` rows per split, inside a temporary folder.

    ``add(split, rows)`` any number of times, then ``commit(manifest)`` writes the last partial
    shards and ``manifest.json`` and renames the folder to ``out``; ``abort()`` (or an exception
    inside ``with``) removes it. ``out`` must not exist unless ``overwrite``; an existing folder is
    replaced only at the final rename.
    """

    def __init__(self, out: str | Path, shard_rows: int, column: str = "input_ids", overwrite: bool = False):
        if shard_rows < 1:
            raise AprError("--shard-rows must be at least 1", [Finding(
                "error", "data.shard_rows", "shards need at least one row", path="--shard-rows",
                expected=">= 1", got=str(shard_rows))])
        self.out, self.shard_rows, self.column, self.overwrite = Path(out), shard_rows, column, overwrite
        self.check_destination()
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".partial", dir=self.out.parent))
            self.tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary folder
        except OSError as e:
            raise _io_error(self.out, e, "cannot create") from None
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_rows: dict[str, int] = {}
        self.splits: dict[str, dict] = {}

    def check_destination(self) -> None:
        check_destination(self.out, self.overwrite)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        return False

    def add(self, split: str, rows: np.ndarray) -> None:
        if split not in self.splits:
            self.splits[split] = {"rows": 0, "tokens": 0, "shards": []}
            self._pending[split], self._pending_rows[split] = [], 0
            try:
                (self.tmp / split).mkdir()
            except OSError as e:
                raise _io_error(self.tmp / split, e, "cannot create") from None
        if len(rows) == 0:
            return
        self._pending[split].append(rows)
        self._pending_rows[split] += len(rows)
        while self._pending_rows[split] >= self.shard_rows:
            self._flush(split, self.shard_rows)

    def _flush(self, split: str, n: int) -> None:
        pending = self._pending[split]
        block = pending[0] if len(pending) == 1 else np.concatenate(pending)
        chunk, rest = block[:n], block[n:]
        self._pending[split] = [rest] if len(rest) else []
        self._pending_rows[split] = len(rest)
        info = self.splits[split]
        name = SHARD_PATTERN.format(len(info["shards"]))
        path = self.tmp / split / name
        try:
            write_shard(path, chunk, self.column)
        except OSError as e:
            raise _io_error(self.out / split / name, e) from None
        info["shards"].append({"file": f"{split}/{name}", "rows": int(len(chunk)), "bytes": path.stat().st_size})
        info["rows"] += int(len(chunk))
        info["tokens"] += int(chunk.size)

    def commit(self, manifest: dict) -> dict:
        """Write the last shards and manifest.json, then move the folder into place."""
        for split in self.splits:
            if self._pending_rows[split]:
                self._flush(split, self._pending_rows[split])
        manifest = dict(manifest)
        manifest.update(format_version=FORMAT_VERSION, input_column=self.column, shard_rows=self.shard_rows,
                        splits=self.splits)
        try:
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            for split in self.splits:
                fsync_dir(self.tmp / split)
            fsync_dir(self.tmp)
            self.check_destination()  # it may have appeared while we worked
            if self.out.exists() or self.out.is_symlink():
                old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".old", dir=self.out.parent))
                os.replace(self.out, old / "replaced")
                os.replace(self.tmp, self.out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.tmp, self.out)
            fsync_dir(self.out.parent)
        except OSError as e:
            self.abort()
            raise _io_error(self.out, e) from None
        except BaseException:
            self.abort()
            raise
        return manifest

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_dataset(out: str | Path, splits: dict[str, np.ndarray], manifest: dict, shard_rows: int,
                  column: str = "input_ids", overwrite: bool = True) -> dict:
    """Write whole in-memory splits (``{"train": rows, "val": rows}``) in the shard format."""
    with DatasetWriter(out, shard_rows, column, overwrite=overwrite) as writer:
        for split, rows in splits.items():
            writer.add(split, rows)
        return writer.commit(manifest)


def shard_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a shard before any byte of it is read (so a FIFO cannot hang the
    reader), or None: missing, not a regular file, unreadable, empty (0 bytes)."""

    try:
        st = check_regular(path, "shard")
    except AprError as err:
        finding = err.findings[0] if err.findings else None
        if finding is None or finding.code == "file.missing":
            return "does not exist"
        return f"is {finding.got}, not a Parquet file"
    if st.st_size == 0:
        return "is empty (0 bytes), not a Parquet file"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return None


def shard_files(path: str | Path) -> list[Path]:
    """The Parquet shards of a dataset, as the loader opens them: ``path`` itself when it is not a
    folder, else every ``*.parquet`` under the folder at any depth, sorted, skipping hidden files and
    folders (a ``.partial`` temporary folder among them). Entries that are not regular files (a FIFO,
    a device, a dangling symlink, a folder named ``*.parquet`` holding no shards) are listed too, so
    that the plan and the loader name them instead of skipping them silently (or hanging on a FIFO);
    a folder named ``*.parquet`` that holds shards (Spark's layout) stands for the shards in it."""
    path = Path(path)
    if not path.is_dir():
        return [path] if os.path.lexists(path) else []
    found = [p for p in path.rglob("*.parquet") if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    holders = {parent for p in found for parent in p.parents}
    return sorted(p for p in found if not (p.is_dir() and p in holders))
