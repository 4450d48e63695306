"""Reading documents from user inputs: folders, .txt, .jsonl and .parquet files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from apr.errors import AprError, Finding

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}


class DataInputError(AprError):
    """An input file cannot be read as documents."""


def _err(path: Path, message: str, expected: str | None = None, got: str | None = None) -> DataInputError:
    return DataInputError(f"{path}: {message}", [Finding("error", "data.input", message, file=str(path),
                                                         expected=expected, got=got)])


def expand_inputs(inputs: list[str | Path], glob: str = "**/*") -> list[Path]:
    """Files named by ``inputs`` (folders searched with ``glob``), sorted within each folder."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.glob(glob) if p.is_file() and not p.name.startswith("."))
            if not found:
                raise _err(path, f"folder holds no files matching {glob!r}", "input files", "none")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise _err(path, "no such file or folder", "an existing file or folder", "nothing")
    return files


def read_documents(path: Path, text_key: str = "text", text_column: str = "text") -> Iterator[str]:
    """Yield the documents of one file: a whole text file, one JSON object per line, or a Parquet column."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with _open_text(path) as lines:
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataInputError(f"{path}:{n}: invalid JSON", [Finding(
                        "error", "data.input", f"invalid JSON: {e.msg}", file=str(path), line=n,
                        column=e.colno)]) from None
                if not isinstance(obj, dict) or text_key not in obj:
                    raise DataInputError(f"{path}:{n}: no key {text_key!r}", [Finding(
                        "error", "data.input", f"line has no key {text_key!r} (use --text-key)",
                        file=str(path), line=n, path=text_key, expected=f"an object with {text_key!r}",
                        got=", ".join(obj) if isinstance(obj, dict) else type(obj).__name__)])
                yield str(obj[text_key])
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception as e:
            raise _err(path, f"not a readable Parquet file ({e})") from None
        if text_column not in schema.names:
            raise _err(path, f"no column {text_column!r} (use --text-column)", f"column {text_column!r}",
                       ", ".join(schema.names))
        table = pq.read_table(path, columns=[text_column])
        for value in table.column(text_column).to_pylist():
            if value:
                yield str(value)
    else:
        with _open_text(path) as f:
            yield f.read()


class _open_text:
    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise _err(self.path, f"cannot read: {e.strerror}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _err(self.path, f"invalid UTF-8 at byte {e.start}", "UTF-8 text", "undecodable bytes") from None
        return iter(text.splitlines(keepends=True)) if self.path.suffix.lower() == ".jsonl" else _Whole(text)

    def __exit__(self, *exc):
        return False


class _Whole:
    def __init__(self, text: str):
        self.text = text

    def read(self) -> str:
        return self.text


def iter_documents(files: list[Path], text_key: str = "text", text_column: str = "text") -> Iterator[str]:
    for path in files:
        yield from read_documents(path, text_key, text_column)
