"""apr/data/pretokenize.py + shards.py: rows, round trip, counts, determinism, atomic output."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apr.data import pretokenize as pretok_module
from apr.data.pretokenize import pretokenize
from apr.data.shards import shard_files
from apr.data.tokenizer import EOT
from apr.errors import AprError
from apr.plan.datafacts import dataset_facts

from .conftest import make_docs, write_txt


def read_rows(folder) -> np.ndarray:
    tables = [pq.read_table(f) for f in shard_files(folder)]
    return np.concatenate([np.array(t.column("input_ids").to_pylist(), dtype=np.int64) for t in tables])


def test_rows_decode_back_to_the_eot_joined_text(tmp_path, corpus, docs, tokenizer, tokenizer_path):
    manifest = pretokenize(sorted(corpus.iterdir()), tokenizer_path, 32, tmp_path / "d", shard_rows=50)
    rows = read_rows(tmp_path / "d" / "train")
    assert rows.shape[1] == 33 and rows.shape[0] == manifest["splits"]["train"]["rows"] > 50
    joined = "".join(doc + EOT for doc in docs)
    decoded = tokenizer.decode(rows.reshape(-1).tolist(), skip_special_tokens=False)
    assert joined.startswith(decoded)  # every token, in order; only the last partial row is missing
    dropped = tokenizer.decode(tokenizer.encode(joined).ids[rows.size:], skip_special_tokens=False)
    assert decoded + dropped == joined
    assert manifest["tokens_dropped"] < 33
    assert manifest["tokens_total"] == rows.size + manifest["tokens_dropped"]
    for row in rows[[0, 7, -1]]:  # any single row is a span of the original text
        assert tokenizer.decode(row.tolist(), skip_special_tokens=False) in joined


def test_counts_agree_with_shards_and_the_plans_parquet_facts(tmp_path, corpus, tokenizer_path, tokenizer):
    out = tmp_path / "d"
    manifest = pretokenize([corpus], tokenizer_path, 16, out, val_fraction=0.1, shard_rows=64, seed=3)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["seq_len"] == 16 and manifest["row_len"] == 17 and manifest["documents"] == 40
    assert manifest["tokenizer"]["sha256"] and manifest["tokenizer"]["eot_id"] == 0
    assert [s["path"] for s in manifest["sources"]] == [str(p) for p in sorted(corpus.iterdir())]
    total = 0
    for split in ("train", "val"):
        info = manifest["splits"][split]
        assert info["rows"] == sum(s["rows"] for s in info["shards"]) == len(read_rows(out / split))
        assert [s["file"] for s in info["shards"]] == \
            [f"{split}/{p.name}" for p in shard_files(out / split)]
        facts = dataset_facts(str(out / split), "input_ids")
        assert facts["sequences"] == info["rows"] and facts["row_len"] == 17
        assert facts["column_type"] == "list<element: uint32>" and facts["has_statistics"]
        assert facts["max_token_id"] < tokenizer.get_vocab_size()
        assert info["tokens"] == info["rows"] * 17
        total += info["rows"]
    assert manifest["splits"]["val"]["rows"] == round(total * 0.1)
    schema = pq.read_schema(shard_files(out / "train")[0])
    assert schema.field("input_ids").type == pa.list_(pa.uint32())
    md = pq.read_metadata(shard_files(out / "train")[0])
    assert md.num_row_groups == 1 and md.row_group(0).column(0).statistics.has_min_max


def test_same_inputs_and_seed_give_byte_identical_output(tmp_path, corpus, tokenizer_path):
    def run(name, seed):
        pretokenize([corpus], tokenizer_path, 16, tmp_path / name, val_fraction=0.2, shard_rows=40, seed=seed)
        return {p.relative_to(tmp_path / name).as_posix(): p.read_bytes()
                for p in sorted((tmp_path / name).rglob("*")) if p.is_file()}

    a, b, c = run("a", 7), run("b", 7), run("c", 8)
    assert a == b and len(a) > 4
    assert a["manifest.json"] != c["manifest.json"]  # the seed picks other val rows ...
    rows = {name: read_rows(tmp_path / name / "train") for name in "ac"}
    assert len(rows["a"]) == len(rows["c"]) and not np.array_equal(rows["a"], rows["c"])  # ... same counts


def test_jsonl_and_parquet_inputs_give_the_same_rows_as_text(tmp_path, docs, tokenizer_path):
    write_txt(tmp_path / "txt", docs)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"body": doc}) + "\n")
    pq.write_table(pa.table({"content": docs}), tmp_path / "docs.parquet")
    pretokenize([tmp_path / "txt"], tokenizer_path, 24, tmp_path / "t")
    pretokenize([tmp_path / "docs.jsonl"], tokenizer_path, 24, tmp_path / "j", text_key="body")
    pretokenize([tmp_path / "docs.parquet"], tokenizer_path, 24, tmp_path / "p", text_column="content")
    t = read_rows(tmp_path / "t")
    assert np.array_equal(t, read_rows(tmp_path / "j")) and np.array_equal(t, read_rows(tmp_path / "p"))


def test_long_documents_encoded_in_pieces_give_the_whole_documents_ids(tmp_path, tokenizer, tokenizer_path,
                                                                      monkeypatch):
    text = "".join(make_docs(30, seed=5))
    (tmp_path / "one.txt").write_text(text)
    monkeypatch.setattr(pretok_module, "PIECE_CHARS", 200)
    monkeypatch.setattr(pretok_module, "BATCH_CHARS", 1000)  # many batches: carries cross batch edges
    cuts = []
    real = pretok_module.document_pieces
    monkeypatch.setattr(pretok_module, "document_pieces", lambda t, n: cuts.append(real(t, n)) or cuts[-1])
    pretokenize([tmp_path / "one.txt"], tokenizer_path, 20, tmp_path / "d")
    assert len(cuts) == 1 and len(cuts[0]) > 50
    ids = tokenizer.encode(text + EOT).ids
    rows = read_rows(tmp_path / "d")
    assert rows.reshape(-1).tolist() == ids[: rows.size]


def test_failures_leave_no_output_and_no_temporary_folder(tmp_path, corpus, tokenizer_path):
    bad = tmp_path / "in" / "zz.txt"
    write_txt(tmp_path / "in", make_docs(5))
    bad.write_bytes(b"fine\n\xff\xfe broken")
    with pytest.raises(AprError, match="zz.txt:2: invalid UTF-8"):
        pretokenize([tmp_path / "in"], tokenizer_path, 8, tmp_path / "out", shard_rows=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]

    pretokenize([corpus], tokenizer_path, 8, tmp_path / "out")
    before = (tmp_path / "out" / "manifest.json").read_text()
    with pytest.raises(AprError, match="already exists"):
        pretokenize([corpus], tokenizer_path, 16, tmp_path / "out")
    assert (tmp_path / "out" / "manifest.json").read_text() == before
    manifest = pretokenize([corpus], tokenizer_path, 16, tmp_path / "out", overwrite=True)
    assert manifest["seq_len"] == 16 and json.loads((tmp_path / "out" / "manifest.json").read_text())["seq_len"] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def test_small_inputs(tmp_path, tokenizer_path):
    (tmp_path / "a.txt").write_text("tiny text")
    with pytest.raises(AprError, match="too little text"):
        pretokenize([tmp_path / "a.txt"], tokenizer_path, 512, tmp_path / "o")
    (tmp_path / "b.txt").write_text(" ".join(["word"] * 60))
    m = pretokenize([tmp_path / "b.txt"], tokenizer_path, 8, tmp_path / "o", val_fraction=0.01)
    assert m["splits"]["val"]["rows"] == 1  # a val split asked for is never empty
    with pytest.raises(AprError, match="seq-len"):
        pretokenize([tmp_path / "b.txt"], tokenizer_path, 0, tmp_path / "o2")
    with pytest.raises(AprError, match="val-fraction"):
        pretokenize([tmp_path / "b.txt"], tokenizer_path, 8, tmp_path / "o2", val_fraction=1.0)
