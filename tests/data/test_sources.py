"""apr/data/sources.py: which files a folder contributes and how each format yields documents."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apr.data.sources import DataInputError, expand_inputs, iter_documents


def test_folders_default_suffixes_glob_and_hidden_files(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    for name in ("b.txt", "a.jsonl", "sub/c.parquet", "sub/deeper/d.txt", "notes.md", "x.pyc", ".e.txt",
                 ".hidden/f.txt"):
        (tmp_path / name).write_text("x")
    assert [p.relative_to(tmp_path).as_posix() for p in expand_inputs([tmp_path])] == \
        ["a.jsonl", "b.txt", "sub/c.parquet", "sub/deeper/d.txt"]
    assert [p.name for p in expand_inputs([tmp_path], "**/*.md")] == ["notes.md"]
    # explicit files come in the order given, whatever their suffix (read as text)
    assert [p.name for p in expand_inputs([tmp_path / "notes.md", tmp_path / "b.txt"])] == ["notes.md", "b.txt"]
    with pytest.raises(DataInputError, match="no files matching"):
        expand_inputs([tmp_path / "sub" / "deeper"], "*.jsonl")
    with pytest.raises(DataInputError, match="no such file"):
        expand_inputs([tmp_path / "nope.txt"])


def test_each_format_yields_its_documents(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffwhole file\nis one document\n".encode())  # BOM dropped
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(o) for o in (
        {"body": "first"}, {"body": ""}, {"body": None}, {"body": "second", "id": 2})) + "\n\n")
    pq.write_table(pa.table({"content": ["p1", None, "", "p2"], "n": [1, 2, 3, 4]}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("")
    files = [tmp_path / n for n in ("a.txt", "b.jsonl", "c.parquet", "d.txt")]
    seen = []
    docs = list(iter_documents(files, text_key="body", text_column="content", on_bytes=seen.append))
    assert docs == ["whole file\nis one document\n", "first", "second", "p1", "p2"]
    assert sum(seen) == sum(f.stat().st_size for f in files)
