"""Facts about pretokenized Parquet shards, read from file footers only (never the data pages).

Row counts, the token column's type and the largest token id (the leaf column's max statistic)
all live in the Parquet footer. The row length is num_values / num_rows of the token column in
each row group: exact when every row holds the same number of tokens, which the data module
guarantees; ragged rows show up as a non-integer or varying ratio. (Rows whose lengths average
out to a whole number in every row group look uniform here; the loader checks the same total.)

Relative paths are resolved against the current directory, as the trainer does.
"""

from __future__ import annotations

import os
from pathlib import Path

from apr.errors import AprError
from apr.readers import content_digest, load_json

_INT_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def resolve(path: str) -> Path:
    """A config path as the trainer opens it: ``~`` expanded, relative to the current directory."""
    return Path(os.path.abspath(os.path.expanduser(path)))


def shard_files(path: Path) -> list[Path]:
    """The Parquet shards the trainer's loader will open: the loader's own listing (the file itself,
    or a folder's ``*.parquet`` searched recursively, entries that are not regular files included so
    that C-DATA-003 names them), so plan and apply count the same rows."""
    from apr.data.shards import shard_files as loader_shard_files

    return loader_shard_files(path)


def input_files(path: Path) -> list[Path]:
    """Every file an input consists of, for the fingerprint (shards, manifest.json, ...): the file
    itself, or every non-hidden file under the folder, recursively, sorted."""
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*")
                      if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    return []


def fingerprint_entries(paths: list[Path]) -> list[dict]:
    """name, size, mtime and content digest of every input file: what `apply` compares to refuse a
    stale plan. The digest (``apr.readers.content_digest``) covers all of a file up to 1 MiB, and
    the head, the tail (a Parquet footer) and 64 samples of a larger one."""

    entries = []
    for root in paths:
        for f in input_files(root):
            st = f.stat()
            try:
                digest = content_digest(f)
            except OSError:  # unreadable: the plan names it; size and mtime still fingerprint it
                digest = None
            entries.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest})
    return entries


def _token_column(md, column: str) -> int | None:
    """Index of the leaf column holding the token ids of ``column`` (e.g. ``input_ids.list.element``)."""
    for j in range(md.num_columns):
        leaf = md.schema.column(j).path.split(".")
        if leaf[0] == column:
            return j
    return None


def _is_int_list(arrow_type) -> bool:
    import pyarrow as pa

    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or \
            pa.types.is_fixed_size_list(arrow_type):
        return str(arrow_type.value_type) in _INT_TYPES
    return False


def dataset_facts(path_text: str, column: str) -> dict:
    """Facts about one dataset (a folder of shards or one shard). Keys absent when unknowable."""
    path = resolve(path_text)
    facts: dict = {"path": path_text, "resolved": str(path), "exists": path.exists(), "is_dir": path.is_dir()}
    if not facts["exists"]:
        return facts
    shards = shard_files(path)
    facts["files"] = len(input_files(path))
    facts["shards"] = len(shards)
    facts["manifest"] = path.is_dir() and (path / "manifest.json").is_file()
    if not shards:
        return facts

    import pyarrow.parquet as pq

    from apr.data.shards import shard_problem

    metas, unreadable = [], []
    for f in shards:
        problem = shard_problem(f)  # a FIFO, a folder, an empty or unreadable file: named, never opened
        if problem is not None:
            unreadable.append(f"{f}: {problem}")
            continue
        try:
            metas.append((f, pq.read_metadata(f)))
        except Exception as e:  # not Parquet, truncated: all the user's to fix
            unreadable.append(f"{f}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    facts["unreadable"] = len(unreadable)
    if unreadable:
        facts["unreadable_example"] = unreadable[0]
        return facts

    facts["sequences"] = sum(md.num_rows for _, md in metas)
    facts["bytes"] = sum(f.stat().st_size for f, _ in metas)
    facts["row_groups"] = sum(md.num_row_groups for _, md in metas)
    first_schema = metas[0][1].schema.to_arrow_schema()
    facts["columns"] = ", ".join(first_schema.names)
    missing = [f.name for f, md in metas if column not in md.schema.to_arrow_schema().names]
    facts["column_present"] = not missing
    if missing:
        facts["column_missing_in"] = missing[0]
        return facts

    arrow_types = [md.schema.to_arrow_schema().field(column).type for _, md in metas]
    facts["column_type"] = " | ".join(sorted({str(t) for t in arrow_types}))
    facts["column_is_int_list"] = all(_is_int_list(t) for t in arrow_types)  # as the loader requires

    lengths: set = set()
    maxima: list[int] = []
    minima: list[int] = []
    has_stats = True
    for _, md in metas:
        j = _token_column(md, column)
        for r in range(md.num_row_groups):
            rg = md.row_group(r)
            if rg.num_rows == 0:
                continue
            chunk = rg.column(j)
            lengths.add(chunk.num_values / rg.num_rows)
            stats = chunk.statistics
            if stats is not None and stats.has_min_max and isinstance(stats.max, int):
                maxima.append(stats.max)
                minima.append(stats.min)
            else:
                has_stats = False
    if len(lengths) == 1 and float(next(iter(lengths))).is_integer():
        facts["row_len"] = int(next(iter(lengths)))
        facts["row_len_uniform"] = True
    elif lengths:
        facts["row_len_uniform"] = False
        facts["row_len_mean"] = sum(lengths) / len(lengths)
    facts["has_statistics"] = has_stats and bool(maxima)
    if facts["has_statistics"]:
        facts["max_token_id"] = max(maxima)
        facts["min_token_id"] = min(minima)
    return facts


def _signature(f: Path) -> tuple:
    """Cheap identity of a shard: size plus its footer (row counts and column statistics)."""
    import pyarrow.parquet as pq

    try:
        md = pq.read_metadata(f)
        return (f.stat().st_size, md.num_rows, repr(md.to_dict()))
    except Exception:
        return (f.stat().st_size, None, ())


def shared_shards(train_text: str, val_text: str) -> int:
    """How many val shards are train shards: the same file, or a copy (same size, rows and stats)."""
    from apr.data.shards import shard_problem

    # only shards that can be read: the others are named by C-DATA-003 and its val twin
    train = [f for f in shard_files(resolve(train_text)) if shard_problem(f) is None]
    val = [f for f in shard_files(resolve(val_text)) if shard_problem(f) is None]
    if not train or not val:
        return 0
    train_real = {os.path.realpath(f) for f in train}
    same = [f for f in val if os.path.realpath(f) in train_real]
    rest = [f for f in val if os.path.realpath(f) not in train_real]
    if rest:
        train_sizes = {f.stat().st_size for f in train}
        candidates = [f for f in rest if f.stat().st_size in train_sizes]
        if candidates:
            train_sigs = {_signature(f) for f in train if f.stat().st_size in {c.stat().st_size for c in candidates}}
            same += [f for f in candidates if _signature(f) in train_sigs]
    return len(same)


def manifest_tokenizer(path_text: str) -> dict | None:
    """The tokenizer the pretokenize manifest beside a dataset records (``DIR/manifest.json``, or
    ``DIR/../manifest.json`` for the ``train/`` and ``val/`` folders ``apr data pretokenize``
    writes): manifest path, sha256, end-of-text token and id. None without a manifest, or when it
    cannot be read or records no digest (nothing to compare)."""
    path = resolve(path_text)
    for folder in (path, path.parent) if path.is_dir() else (path.parent,):
        manifest = folder / "manifest.json"
        if not manifest.is_file():
            continue
        try:
            doc = load_json(manifest, "manifest", "pretokenize manifest")
        except AprError:  # unreadable or not JSON: not apr's manifest, nothing to compare against
            return None
        tok = doc.get("tokenizer") if isinstance(doc, dict) else None
        sha = tok.get("sha256") if isinstance(tok, dict) else None
        if not isinstance(sha, str) or not sha:
            return None
        eot_token, eot_id = tok.get("eot_token"), tok.get("eot_id")
        return {"manifest": str(manifest), "sha256": sha[:128],
                "tokenizer_path": str(tok.get("path"))[:500] if tok.get("path") is not None else None,
                "eot_token": eot_token[:100] if isinstance(eot_token, str) else None,
                "eot_id": eot_id if isinstance(eot_id, int) and not isinstance(eot_id, bool) else None}
    return None


def data_manifests(data) -> list[dict]:
    """``manifest_tokenizer`` of every input of ``data`` (a DataConfig) that has one, each with
    ``where`` (``train``, ``val``, ``source 'web'``, ``source 'web' val``), in config order."""
    if data.sources is None:
        inputs = [("train", data.train)]
    else:
        inputs = [(f"source {s.name!r}", s.path) for s in data.sources]
        inputs += [(f"source {s.name!r} val", s.val) for s in data.sources if s.val]
    if data.val:
        inputs.append(("val", data.val))
    out = []
    for where, path_text in inputs:
        m = manifest_tokenizer(path_text)
        if m is not None:
            out.append({"where": where, **m})
    return out
