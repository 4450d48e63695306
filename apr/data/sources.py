"""Reading documents from user inputs: folders, text files, ``.jsonl`` and ``.parquet``.

A text file (``.txt`` or any suffix other than the two below) is one document. A ``.jsonl`` file
holds one JSON object per line, its document under ``text_key``. A ``.parquet`` file holds one
document per row in the string column ``text_column``. Empty documents are skipped.

Every problem is an ``AprError`` naming the file (and, for ``.jsonl``, the line), raised while
the documents are read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from apr.errors import AprError, Finding
from apr.quoting import quote_key

DEFAULT_SUFFIXES = (".txt", ".jsonl", ".parquet")  # what a folder contributes when no --glob is given
OnBytes = Callable[[int], None]


class DataInputError(AprError):
    """An input cannot be read as documents."""


def _err(path: Path, message: str, line: int | None = None, expected: str | None = None,
         got: str | None = None, key: str = "") -> DataInputError:
    where = f"{path}:{line}" if line is not None else str(path)
    return DataInputError(f"{where}: {message}", [Finding(
        "error", "data.input", message, path=key, file=str(path), line=line, expected=expected, got=got)])


def expand_inputs(inputs: list[str | Path], glob: str | None = None) -> list[Path]:
    """The files named by ``inputs``, in the order given; a folder contributes its files matching
    ``glob`` (default: ``.txt``, ``.jsonl`` and ``.parquet`` files at any depth), sorted, skipping
    hidden files and folders."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            if glob:
                found = path.glob(glob)
            else:
                found = (p for p in path.rglob("*") if p.suffix.lower() in DEFAULT_SUFFIXES)
            found = sorted(p for p in found if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                pattern = repr(glob) if glob else " or ".join(f"*{s}" for s in DEFAULT_SUFFIXES)
                raise _err(path, f"folder holds no files matching {pattern}", expected="input files", got="none")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise _err(path, "not a regular file or folder", expected="a file or folder")
        else:
            raise _err(path, "no such file or folder", expected="an existing file or folder", got="nothing")
    return files


def input_bytes(files: list[Path]) -> int:
    """Total size of the inputs: the unit of the progress bar."""
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise _err(path, f"cannot read: {e.strerror or e}", expected="a readable file") from None


def _decode(path: Path, data: bytes, line: int | None = None, first: bool = True) -> str:
    try:
        return data.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        if line is None:
            line = data.count(b"\n", 0, e.start) + 1
            col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        else:
            col = e.start + 1
        raise DataInputError(f"{path}:{line}: invalid UTF-8", [Finding(
            "error", "data.input", f"invalid UTF-8 (byte 0x{data[e.start]:02x})", file=str(path), line=line,
            column=col, expected="UTF-8 text", got="undecodable bytes")]) from None


def _read_text(path: Path, on_bytes: OnBytes | None) -> Iterator[str]:
    data = _read_bytes(path)
    text = _decode(path, data)
    if on_bytes is not None:
        on_bytes(len(data))
    if text:
        yield text


def _read_jsonl(path: Path, text_key: str, on_bytes: OnBytes | None) -> Iterator[str]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _err(path, f"cannot read: {e.strerror or e}", expected="a readable file") from None
    pending = 0
    with f:
        n = 0
        while True:
            try:
                raw = f.readline()
            except OSError as e:
                raise _err(path, f"cannot read: {e.strerror or e}", line=n + 1) from None
            if not raw:
                break
            n += 1
            pending += len(raw)
            if on_bytes is not None and pending >= 1 << 20:
                on_bytes(pending)
                pending = 0
            line = _decode(path, raw, line=n, first=n == 1)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataInputError(f"{path}:{n}: invalid JSON", [Finding(
                    "error", "data.input", f"invalid JSON: {e.msg}", file=str(path), line=n,
                    column=e.colno, expected="one JSON object per line")]) from None
            except RecursionError:
                raise DataInputError(f"{path}:{n}: JSON nested too deeply", [Finding(
                    "error", "data.input", "JSON nested too deeply to parse", file=str(path), line=n,
                    expected="one JSON object per line, with its text at the top level",
                    got="deeply nested arrays or objects")]) from None
            if not isinstance(obj, dict) or text_key not in obj:
                got = ("keys " + ", ".join(map(quote_key, list(obj)[:8]))) if isinstance(obj, dict) \
                    else f"a JSON {type(obj).__name__}"
                raise _err(path, f"no key {text_key!r} (choose one with --text-key)", line=n, key=text_key,
                           expected=f"an object with key {text_key!r}", got=got)
            value = obj[text_key]
            if not isinstance(value, str):
                if value is None:
                    continue
                raise _err(path, f"key {text_key!r} holds a {type(value).__name__}, not a string", line=n,
                           key=text_key, expected="a string", got=type(value).__name__)
            if value:
                yield value
    if on_bytes is not None and pending:
        on_bytes(pending)


def _read_parquet(path: Path, text_column: str, on_bytes: OnBytes | None) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except OSError as e:
        raise _err(path, f"cannot read: {e.strerror or e}") from None
    except Exception as e:  # ArrowInvalid for a file that is not Parquet
        raise _err(path, f"not a readable Parquet file: {str(e).splitlines()[0][:200]}",
                   expected="a Parquet file") from None
    if text_column not in schema.names:
        raise _err(path, f"no column {text_column!r} (choose one with --text-column)", key=text_column,
                   expected=f"a string column {text_column!r}", got="columns " + ", ".join(schema.names[:12]))
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise _err(path, f"column {text_column!r} has type {kind}, not string", key=text_column,
                   expected="string", got=str(kind))
    size = path.stat().st_size
    rows = max(pf.metadata.num_rows, 1)
    try:
        for batch in pf.iter_batches(batch_size=4096, columns=[text_column]):
            values = batch.column(0).to_pylist()
            if on_bytes is not None:
                on_bytes(size * len(values) // rows)
            for value in values:
                if value:
                    yield value
    except AprError:
        raise
    except Exception as e:  # a corrupt page, or string data that is not UTF-8
        raise _err(path, f"cannot read column {text_column!r}: {str(e).splitlines()[0][:200]}",
                   key=text_column) from None


def read_documents(path: Path, text_key: str = "text", text_column: str = "text",
                   on_bytes: OnBytes | None = None) -> Iterator[str]:
    """The non-empty documents of one file, by its suffix."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, text_key, on_bytes)
    if suffix == ".parquet":
        return _read_parquet(path, text_column, on_bytes)
    return _read_text(path, on_bytes)


def iter_documents(files: list[Path], text_key: str = "text", text_column: str = "text",
                   on_bytes: OnBytes | None = None) -> Iterator[str]:
    for path in files:
        yield from read_documents(path, text_key, text_column, on_bytes)
