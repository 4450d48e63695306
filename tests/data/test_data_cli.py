"""`apr data train-tokenizer` and `apr data pretokenize` through the CLI: success output and every
bad input failing with exit 1, a message naming the file (and line), and no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from apr.data import sources

from .conftest import assert_clean_failure, make_docs, write_txt


def test_train_tokenizer_and_pretokenize(tmp_path, cli, corpus):
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "300", "--out", tmp_path / "tok.json",
              "--special-tokens", "<|pad|>,<|sep|>")
    assert res.exit_code == 0, res.output
    assert "vocab 300" in res.output and "<|endoftext|>, <|pad|>, <|sep|>" in res.output
    res = cli("data", "pretokenize", corpus, "--tokenizer", tmp_path / "tok.json", "--seq-len", "16",
              "--out", tmp_path / "d", "--val-fraction", "0.1", "--shard-rows", "100", "--seed", "1")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert f"train {manifest['splits']['train']['rows']:,} rows" in res.output
    assert manifest["shard_rows"] == 100 and manifest["seed"] == 1 and manifest["seq_len"] == 16


def test_glob_text_key_text_column_and_input_column(tmp_path, cli, tokenizer_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.md").write_text("\n".join(make_docs(8)))
    with open(folder / "b.jsonl", "w") as f:
        for doc in make_docs(8, seed=1):
            f.write(json.dumps({"body": doc}) + "\n")
    pq.write_table(pa.table({"content": make_docs(8, seed=2)}), folder / "c.parquet")
    res = cli("data", "pretokenize", folder, "--glob", "*.[mj]*", "--text-key", "body", "--tokenizer",
              tokenizer_path, "--seq-len", "8", "--out", tmp_path / "d", "--input-column", "tokens")
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert [s["path"].rsplit("/", 1)[1] for s in manifest["sources"]] == ["a.md", "b.jsonl"]
    assert manifest["input_column"] == "tokens"
    assert pq.read_schema(tmp_path / "d" / "train" / "shard-00000.parquet").names == ["tokens"]
    res = cli("data", "pretokenize", folder / "c.parquet", "--text-column", "content", "--tokenizer",
              tokenizer_path, "--seq-len", "8", "--out", tmp_path / "p")
    assert res.exit_code == 0, res.output


def pretok(cli, tokenizer_path, out, *inputs, extra=()):
    return cli("data", "pretokenize", *inputs, "--tokenizer", tokenizer_path, "--seq-len", "8", "--out", out,
               *extra)


def test_invalid_utf8_names_the_file_and_line(tmp_path, cli, tokenizer_path):
    write_txt(tmp_path / "in", make_docs(3))
    (tmp_path / "in" / "bad.txt").write_bytes(b"ok\nstill ok\nbroken \xc3\x28 here\n")
    res = pretok(cli, tokenizer_path, tmp_path / "out", tmp_path / "in")
    assert_clean_failure(res, "bad.txt:3", "invalid UTF-8")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "\xff"}\n')
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "out", tmp_path / "bad.jsonl"),
                         "bad.jsonl:3", "invalid UTF-8")
    assert not (tmp_path / "out").exists()


def test_bad_jsonl_lines(tmp_path, cli, tokenizer_path):
    (tmp_path / "k.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n')
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "k.jsonl"),
                         "k.jsonl:3", "no key 'text'", "--text-key", "'body'")
    (tmp_path / "j.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "j.jsonl"),
                         "j.jsonl:2", "invalid JSON")
    (tmp_path / "n.jsonl").write_text('{"text": 5}\n')
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "n.jsonl"),
                         "n.jsonl:1", "not a string")


def test_missing_or_non_text_parquet_column(tmp_path, cli, tokenizer_path):
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), tmp_path / "t.parquet")
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "t.parquet"),
                         "t.parquet", "no column 'text'", "--text-column", "body, n")
    res = pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "t.parquet", extra=("--text-column", "n"))
    assert_clean_failure(res, "t.parquet", "column 'n' has type int64")
    (tmp_path / "fake.parquet").write_text("not parquet")
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "fake.parquet"),
                         "fake.parquet", "not a readable Parquet file")


def test_empty_input(tmp_path, cli, tokenizer_path):
    (tmp_path / "empty.txt").write_text("")
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "empty.txt"), "empty.txt", "no text")
    res = cli("data", "train-tokenizer", tmp_path / "empty.txt", "--vocab-size", "300", "--out", tmp_path / "t.json")
    assert_clean_failure(res, "no text")
    (tmp_path / "e").mkdir()
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "e"), "no files matching")
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o"), "no input given")
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", tmp_path / "missing.txt"),
                         "missing.txt", "no such file")


def test_unreadable_file(tmp_path, cli, tokenizer_path, monkeypatch):
    locked = tmp_path / "locked.txt"
    locked.write_text("secret words " * 50)
    if os.geteuid() == 0:  # root reads anything: make the open itself fail as it would for a user
        real_open = open

        def guarded(path, *args, **kwargs):
            if str(path) == str(locked):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(sources, "open", guarded, raising=False)
    else:
        locked.chmod(0)
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", locked), "locked.txt", "Permission denied")


def test_tokenizer_that_does_not_load(tmp_path, cli, corpus):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "Nope"}}')
    assert_clean_failure(pretok(cli, broken, tmp_path / "o", corpus), "broken.json", "cannot load tokenizer")
    assert_clean_failure(pretok(cli, tmp_path / "none.json", tmp_path / "o", corpus), "none.json", "not found")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "noeot.json"))
    assert_clean_failure(pretok(cli, tmp_path / "noeot.json", tmp_path / "o", corpus), "noeot.json",
                         "no end-of-text token", "--eot-token")
    assert not (tmp_path / "o").exists()


def test_existing_output_and_bad_numbers(tmp_path, cli, tokenizer_path, corpus):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("mine")
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", corpus), str(tmp_path / "o"), "already exists",
                         "--overwrite")
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"
    # --overwrite replaces only an earlier output: a folder apr did not write is left alone
    assert_clean_failure(pretok(cli, tokenizer_path, tmp_path / "o", corpus, extra=("--overwrite",)),
                         "not an earlier pretokenize output")
    assert (tmp_path / "o" / "keep.txt").read_text() == "mine"
    assert pretok(cli, tokenizer_path, tmp_path / "p", corpus).exit_code == 0
    assert pretok(cli, tokenizer_path, tmp_path / "p", corpus, extra=("--overwrite",)).exit_code == 0
    assert (tmp_path / "p" / "manifest.json").exists()
    res = cli("data", "pretokenize", corpus, "--tokenizer", tokenizer_path, "--seq-len", "lots", "--out",
              tmp_path / "x")
    assert_clean_failure(res, "--seq-len")
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "100", "--out", tmp_path / "t.json")
    assert_clean_failure(res, "--vocab-size 100 is too small")


def test_the_installed_command_exits_1_without_a_traceback(tmp_path, tokenizer_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    proc = subprocess.run([sys.executable, "-m", "apr", "data", "pretokenize", str(tmp_path / "bad.jsonl"),
                           "--tokenizer", str(tokenizer_path), "--seq-len", "8", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "bad.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_progress_line_on_a_terminal_and_in_a_log():
    import io

    from apr.cli.cmd_data import ProgressLine

    tty = ProgressLine("pretokenize", stream=io.StringIO(), tty=True)
    tty(1_000_000, 4_000_000, 300_000)
    assert tty.stream.getvalue() == ""  # quick work draws nothing
    tty.t0 -= 2.0
    tty(1_000_000, 4_000_000, 300_000)
    tty.close()
    drawn = tty.stream.getvalue()
    assert drawn.startswith("\rpretokenize [#####               ]  25% 1.0/4.0 MB, 0.30M tokens") and "eta" in drawn
    assert drawn.endswith("\r\x1b[K")  # the line is cleared before the summary is printed

    log = ProgressLine("pretokenize", stream=io.StringIO(), tty=False, log_every=10.0)
    log(1, 4, 10)
    assert log.stream.getvalue() == ""
    log.t0 -= 11.0
    log(2, 4, 20)
    log(3, 4, 30)  # not again within log_every
    assert log.stream.getvalue().startswith("pretokenize  50% ") and "\r" not in log.stream.getvalue()
    assert log.stream.getvalue().count("\n") == 1


def test_train_tokenizer_never_writes_over_an_input_a_device_or_an_existing_file(tmp_path, cli, corpus):
    corpus_file = sorted(p for p in corpus.rglob("*") if p.is_file())[0] if corpus.is_dir() else corpus
    text = corpus_file.read_bytes()
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "300", "--out", corpus_file, "--overwrite")
    assert res.exit_code == 1 and "is an input of this command" in res.output and "Traceback" not in res.output
    assert corpus_file.read_bytes() == text
    inode = os.stat("/dev/null").st_ino
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "300", "--out", "/dev/null", "--overwrite")
    assert res.exit_code == 1 and "is a device" in res.output and os.stat("/dev/null").st_ino == inode
    out = tmp_path / "tok.json"
    out.write_text("mine")
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "300", "--out", out)
    assert res.exit_code == 1 and "--overwrite" in res.output and out.read_text() == "mine"
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "300", "--out", out, "--overwrite")
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["model"]["type"] == "BPE"


def test_sizes_without_units_and_absurd_counts_are_refused(tmp_path, cli, corpus):
    res = cli("data", "train-tokenizer", "--builtin", "stdlib", "--builtin-max-bytes", "4", "--vocab-size", "300",
              "--out", tmp_path / "tok.json")
    assert_clean_failure(res, "--builtin-max-bytes")
    assert "4GiB" in res.output
    res = cli("data", "train-tokenizer", corpus, "--vocab-size", "1e20", "--out", tmp_path / "tok.json")
    assert_clean_failure(res, "--vocab-size")
    assert not (tmp_path / "tok.json").exists()
