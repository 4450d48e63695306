"""Everything a run needs from one text file (apr/data/textrun.py): a tokenizer, shards and a config
that validates; a file too short for one row, or a folder in use, is refused with the reason."""

from __future__ import annotations

import pytest

from apr.config import load_config
from apr.data.loader import ShardLoader
from apr.data.textrun import prepare_text_run
from apr.data.tokenizer import load_tokenizer
from apr.errors import AprError

TEXT = "".join(f"line {i}: the cat sat on the mat, and the dog sat on the log.\n" for i in range(60))


def test_a_text_file_becomes_a_tokenizer_shards_and_a_config(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    run = prepare_text_run(src, tmp_path / "out", seq_len=32, batch_size=4)
    config = load_config(run.config).config
    tok = load_tokenizer(run.tokenizer)
    assert run.vocab_size == tok.get_vocab_size() == 2 + len(set(TEXT))  # char: every character, 2 specials
    assert config.model.architecture.vocab_size == 64 and config.data.seq_len == 32
    assert config.data.tokenizer == str(run.tokenizer.resolve()) and config.data.val is not None
    rows = list(ShardLoader(config.data.train, shuffle=False, batch_size=4, seq_len=32).iter_sequential(1))
    assert tok.decode(rows[0][0].tolist()) == TEXT[:33]  # the file's first 33 characters, as written
    assert run.train_rows + run.val_rows == (len(TEXT) + 1) // 33  # one end-of-text id after the document


def test_a_file_too_short_for_one_row_and_a_used_folder_are_refused(tmp_path):
    src = tmp_path / "short.txt"
    src.write_text("too short")
    with pytest.raises(AprError, match="too little text for one row of 33 tokens") as err:
        prepare_text_run(src, tmp_path / "out", seq_len=32)
    assert err.value.findings[0].expected == "at least 33 tokens (seq_len + 1)"
    src.write_text(TEXT)
    with pytest.raises(AprError, match="not empty"):
        prepare_text_run(src, tmp_path / "out", seq_len=32)
    assert prepare_text_run(src, tmp_path / "out", seq_len=32, overwrite=True).train_rows > 0
