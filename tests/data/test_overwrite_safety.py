"""--overwrite replaces only an earlier output, never an input or an unrelated folder; outputs are
created with ordinary permissions."""

from __future__ import annotations

import os

import pytest

from apr.data.pretokenize import pretokenize
from apr.data.tokenizer import train_tokenizer
from apr.errors import AprError


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("\n".join(f"def f{i}(x):\n    return x * {i} + 1" for i in range(300)))
    tok = tmp_path / "tok.json"
    train_tokenizer([(src / "a.txt").read_text()], vocab_size=300, out=tok)
    return src, tok


def test_overwrite_refuses_an_input_folder_and_a_foreign_folder(tmp_path, corpus):
    src, tok = corpus
    with pytest.raises(AprError, match="would replace the input"):
        pretokenize([src], tok, 8, src, overwrite=True)
    assert (src / "a.txt").exists()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("x")
    with pytest.raises(AprError, match="not an earlier pretokenize output"):
        pretokenize([src], tok, 8, precious, overwrite=True)
    assert (precious / "keep.txt").read_text() == "x"


def test_overwrite_replaces_an_earlier_output_with_ordinary_permissions(tmp_path, corpus):
    src, tok = corpus
    out = tmp_path / "data"
    pretokenize([src], tok, 8, out)
    with pytest.raises(AprError, match="already exists"):
        pretokenize([src], tok, 8, out)
    pretokenize([src], tok, 16, out, overwrite=True)
    assert '"seq_len": 16' in (out / "manifest.json").read_text()
    umask = os.umask(0)
    os.umask(umask)
    assert tok.stat().st_mode & 0o777 == 0o666 & ~umask
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
