"""The built-in corpus (this Python's standard library) and `--builtin stdlib` through the CLI."""

from __future__ import annotations

import json

import pytest

from apr.data.corpus import DEFAULT_MAX_BYTES, builtin_corpus_files, stdlib_root
from apr.errors import AprError

from .conftest import assert_clean_failure


def test_stdlib_files_are_a_stable_capped_sample_of_decodable_source():
    files = builtin_corpus_files("stdlib")
    assert files == builtin_corpus_files("stdlib") == sorted(files)
    sizes = [f.stat().st_size for f in files]
    assert DEFAULT_MAX_BYTES * 0.9 < sum(sizes) <= DEFAULT_MAX_BYTES
    rel = [f.relative_to(stdlib_root()).parts for f in files]
    assert not any({"site-packages", "test", "tests"} & set(parts) for parts in rel)
    assert len({parts[0] for parts in rel}) > 20  # spread over the library, not its first modules
    for f in files:
        f.read_text(encoding="utf-8")  # the test suites' deliberately broken files are not taken
    small = builtin_corpus_files("stdlib", 200_000)
    assert sum(f.stat().st_size for f in small) <= 200_000 and set(small) < set(files)
    with pytest.raises(AprError, match="unknown built-in corpus"):
        builtin_corpus_files("wikipedia")


def test_builtin_through_the_cli(tmp_path, cli):
    res = cli("data", "train-tokenizer", "--builtin", "stdlib", "--builtin-max-bytes", "300K", "--vocab-size",
              "512", "--out", tmp_path / "tok.json")
    assert res.exit_code == 0, res.output
    res = cli("data", "pretokenize", "--builtin", "stdlib", "--builtin-max-bytes", "300K", "--tokenizer",
              tmp_path / "tok.json", "--seq-len", "64", "--val-fraction", "0.05", "--out", tmp_path / "d")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert all(s["path"].startswith("stdlib:") for s in manifest["sources"])
    assert manifest["splits"]["train"]["rows"] > 500 and manifest["splits"]["val"]["rows"] > 20
    assert_clean_failure(cli("data", "train-tokenizer", "--builtin", "nope", "--vocab-size", "512", "--out",
                             tmp_path / "t2.json"), "unknown built-in corpus")


def test_the_demo_gets_enough_rows(tmp_path, cli):
    """scripts/demo.sh: vocab 2048, seq_len 128, 150 steps of batch 16 need 2,400 training rows."""
    assert cli("data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--out",
               tmp_path / "tok.json").exit_code == 0
    res = cli("data", "pretokenize", "--builtin", "stdlib", "--tokenizer", tmp_path / "tok.json", "--seq-len", "128",
              "--val-fraction", "0.05", "--seed", "0", "--out", tmp_path / "d")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["rows"] >= 3 * 2400
    assert manifest["splits"]["val"]["rows"] >= 8 * 16  # eval_batches x batch_size
