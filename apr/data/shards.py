"""The shard format: Parquet files with one ``list<uint32>`` column, rows of exactly seq_len + 1 tokens."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from apr.fsutil import fsync_dir

SHARD_PATTERN = "shard-{:05d}.parquet"
FORMAT_VERSION = 1


def write_shard(path: Path, rows: np.ndarray, column: str = "input_ids") -> None:
    """Write ``rows`` ([n, seq_len + 1] uint32) as one Parquet file with column statistics on."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = np.ascontiguousarray(rows, dtype=np.uint32)
    n, width = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    values = pa.array(rows.reshape(-1))
    table = pa.table({column: pa.ListArray.from_arrays(offsets, values)})
    pq.write_table(table, path, write_statistics=True, compression="zstd", row_group_size=max(n, 1))


def write_dataset(out: Path, splits: dict[str, np.ndarray], manifest: dict, shard_rows: int,
                  column: str = "input_ids") -> dict:
    """Write ``DIR/<split>/shard-*.parquet`` + ``DIR/manifest.json`` into a temp folder, then rename,
    so a half-written output never looks complete."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        manifest = dict(manifest)
        manifest["format_version"] = FORMAT_VERSION
        manifest["input_column"] = column
        manifest["splits"] = {}
        for split, rows in splits.items():
            (tmp / split).mkdir()
            shards = []
            for i, start in enumerate(range(0, max(len(rows), 1), shard_rows)):
                chunk = rows[start:start + shard_rows]
                if len(chunk) == 0:
                    break
                name = SHARD_PATTERN.format(i)
                write_shard(tmp / split / name, chunk, column)
                shards.append({"file": f"{split}/{name}", "rows": int(len(chunk))})
            manifest["splits"][split] = {"rows": int(len(rows)), "tokens": int(rows.size), "shards": shards}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        fsync_dir(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def shard_files(path: str | Path) -> list[Path]:
    """The Parquet shards under ``path`` (a file or a folder, searched recursively), sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*.parquet") if not any(part.startswith(".") for part in p.parts[-2:]))
