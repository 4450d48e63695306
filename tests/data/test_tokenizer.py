"""apr/data/tokenizer.py: training is reproducible, loading fails cleanly, documents may be cut."""

from __future__ import annotations

import pytest

from apr.data.pretokenize import document_pieces
from apr.data.tokenizer import EOT, find_eot, load_tokenizer, splits_at_newlines, train_tokenizer
from apr.errors import AprError

from .conftest import make_docs


def test_training_is_byte_identical_and_eot_is_id_0(tmp_path, docs):
    a = train_tokenizer(docs, 350, tmp_path / "a.json", special_tokens=["<|pad|>", EOT])
    b = train_tokenizer(iter(docs), 350, tmp_path / "b.json", special_tokens=["<|pad|>", EOT])
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a["sha256"] == b["sha256"] and a["vocab_size"] == 350
    assert a["special_tokens"] == [EOT, "<|pad|>"]  # EOT first, duplicates dropped
    tok = load_tokenizer(tmp_path / "a.json")
    assert tok.token_to_id(EOT) == 0 and tok.token_to_id("<|pad|>") == 1
    text = "def main():\n    return 42  # ünïcödé 🙂\n"
    assert tok.decode(tok.encode(text).ids) == text  # byte level: any text round-trips


def test_vocab_too_small_and_empty_input(tmp_path):
    with pytest.raises(AprError, match="too small"):
        train_tokenizer(["some text"], 100, tmp_path / "t.json")
    with pytest.raises(AprError, match="no text"):
        train_tokenizer(["", ""], 300, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": 3}')
    for path in (bad, tmp_path / "missing.json", tmp_path):
        with pytest.raises(AprError) as info:
            load_tokenizer(path)
        assert info.value.findings[0].file == str(path)


def test_hostile_tokenizer_files_are_clear_errors(tmp_path):
    import os

    from apr.plan.tokfacts import tokenizer_facts

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it for reading would block forever
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(2**30)
    deep = tmp_path / "deep.json"
    deep.write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for path, code in ((fifo, "file.not_regular"), (huge, "file.too_large"), (deep, "data.tokenizer")):
        with pytest.raises(AprError) as info:
            load_tokenizer(path)
        assert info.value.findings[0].code == code and info.value.findings[0].file == str(path)
        facts = tokenizer_facts(str(path))
        assert facts["loaded"] is False and facts["error"]
    assert "FIFO" in tokenizer_facts(str(fifo))["error"]


def test_find_eot(tokenizer, tokenizer_path):
    assert find_eot(tokenizer, tokenizer_path) == (EOT, 0)
    with pytest.raises(AprError, match="no end-of-text token"):
        find_eot(tokenizer, tokenizer_path, "</s>")


def test_cutting_documents_at_safe_newlines_keeps_the_token_ids(tokenizer):
    """The pretokenizer encodes long documents in pieces: ids must equal the whole document's."""
    assert splits_at_newlines(tokenizer)
    texts = make_docs(6, seed=3, words=400) + [
        "a\nb\n\nc \nd\n e\r\nf\n\tg\nh'\n's x\n1\n2\nü\n東京\n🙂\n\u00a0x\n\x1cy\nz",
        "word\n" * 300, "  lead\nx  \n  y\n" * 50,
    ]
    for text in texts:
        pieces = document_pieces(text, piece_chars=7)
        assert "".join(pieces) == text
        cut = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False).ids]
        assert cut == tokenizer.encode(text, add_special_tokens=False).ids
    assert len(document_pieces(texts[0], piece_chars=7)) > 20


def test_tokenizers_that_may_not_be_cut(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not splits_at_newlines(tok)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.normalizer = normalizers.NFKC()
    assert not splits_at_newlines(tok)


def test_vocab_size_beyond_uint32_is_refused(tmp_path):
    with pytest.raises(AprError, match="too large") as info:
        train_tokenizer(["some text"], 10**20, tmp_path / "t.json")
    assert info.value.findings[0].expected == "at most 4,294,967,296"
    assert not (tmp_path / "t.json").exists()


def test_a_character_tokenizer_gives_one_id_per_character_and_decodes_back(tmp_path):
    from apr.data.tokenizer import UNK, train_char_tokenizer

    docs = ["abba\n\n  cab", "é!"]
    info = train_char_tokenizer(docs, None, tmp_path / "c.json")
    again = train_char_tokenizer(docs, None, tmp_path / "d.json")
    assert info["sha256"] == again["sha256"]  # deterministic
    tok = load_tokenizer(tmp_path / "c.json")
    # ids: specials first, then characters by count (a: 3, b: 3, space: 2, newline: 2, ...), ties by code point
    assert [tok.id_to_token(i) for i in range(6)] == [EOT, UNK, "a", "b", "\n", " "]
    assert info["vocab_size"] == tok.get_vocab_size() == 2 + len(set("".join(docs)))
    text = "ab\n\n c é!"
    enc = tok.encode(text)
    assert enc.tokens == list(text) and tok.decode(enc.ids) == text
    assert tok.encode("az").tokens == ["a", UNK]  # a character the file lacks
    assert find_eot(tok, tmp_path / "c.json") == (EOT, 0)
    capped = train_char_tokenizer(docs, 4, tmp_path / "e.json")  # the 2 most frequent characters kept
    assert capped["vocab_size"] == 4 and capped["unknown_chars"] == len(set("".join(docs))) - 2
    assert load_tokenizer(tmp_path / "e.json").encode("abc").tokens == ["a", "b", UNK]
    with pytest.raises(AprError, match="too small"):
        train_char_tokenizer(docs, 2, tmp_path / "f.json")
