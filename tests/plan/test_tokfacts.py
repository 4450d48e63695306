"""The tokenizer the data was made with (the pretokenize manifest's sha256) against data.tokenizer:
a different tokenizer of the same size is an error at data.tokenizer naming both digests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from plan_helpers import apr_cli

from apr.data.pretokenize import pretokenize
from apr.data.tokenizer import train_tokenizer
from apr.plan.examples import BASE_CONFIG, deep_merge, to_yaml

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def corpus(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [" ".join(WORDS[(i * 7 + j * seed) % len(WORDS)] for j in range(12)) for i in range(300)]
    (folder / "a.txt").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two byte-level tokenizers of the same size (trained on different text, one with an extra
    special token first) and data pretokenized with the first."""
    root = tmp_path_factory.mktemp("tok")
    text = corpus(root / "text", 1)
    tok_a = root / "a.json"
    tok_b = root / "b.json"
    train_tokenizer([(text / "a.txt").read_text()], 300, tok_a)
    train_tokenizer([" ".join(f"n{i * 37 % 1000}x{i}" for i in range(3000))], 300, tok_b,
                    special_tokens=["<|pad|>"])
    pretokenize([text], tok_a, 32, root / "data", val_fraction=0.2)
    pretokenize([text], tok_a, 32, root / "src_x", val_fraction=0.2)
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(tok_a)).get_vocab_size() == Tokenizer.from_file(str(tok_b)).get_vocab_size() == 300
    return root, tok_a, tok_b


def plan_json(root: Path, tmp: Path, tokenizer: Path, data: dict) -> tuple[dict, int]:
    doc = deep_merge(BASE_CONFIG, {"data": {"tokenizer": str(tokenizer), **data},
                                   "model": {"architecture": {"vocab_size": 300}}})
    (tmp / "c.yaml").write_text(to_yaml(doc))
    r = apr_cli("train", "plan", str(tmp / "c.yaml"), "--json", cwd=tmp)
    return json.loads(r.stdout), r.returncode


def finding(doc: dict, code: str) -> dict | None:
    return next((f for f in doc["findings"] if f.get("code") == code), None)


def test_the_plan_refuses_data_made_with_another_tokenizer_of_the_same_size(made, tmp_path):
    root, tok_a, tok_b = made
    data = {"train": str(root / "data" / "train"), "val": str(root / "data" / "val")}
    ok, rc = plan_json(root, tmp_path, tok_a, data)
    assert finding(ok, "C-TOK-007") is None
    doc, rc = plan_json(root, tmp_path, tok_b, data)
    f = finding(doc, "C-TOK-007")
    assert rc == 1 and f is not None and f["severity"] == "error" and f["path"] == "data.tokenizer"
    sha_a = hashlib.sha256(tok_a.read_bytes()).hexdigest()
    sha_b = hashlib.sha256(tok_b.read_bytes()).hexdigest()
    assert sha_a in f["message"] and sha_b in f["message"]
    assert "the train data was made with another tokenizer" in f["message"]
    assert str(root / "data" / "manifest.json") in f["message"]
    # both tokenizers have 300 tokens, so the size checks pass: only the digest tells them apart
    assert finding(doc, "C-TOK-005") is None and finding(doc, "C-TOK-002") is None


def test_the_special_tokens_are_compared_too(made, tmp_path):
    root, tok_a, _ = made
    manifest = json.loads((root / "data" / "manifest.json").read_text())
    assert manifest["tokenizer"]["eot_id"] == 0  # <|endoftext|> comes first in both
    # a tokenizer whose end-of-text token has another id: its special tokens in another order
    from tokenizers import Tokenizer
    spec = json.loads(tok_a.read_text())
    spec["added_tokens"][0]["id"] = 299
    spec["model"]["vocab"]["<|endoftext|>"] = 299
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(spec))
    Tokenizer.from_file(str(moved))  # still a tokenizer
    doc, rc = plan_json(root, tmp_path, moved, {"train": str(root / "data" / "train")})
    f = finding(doc, "C-TOK-007")
    assert rc == 1 and f is not None
    assert "'<|endoftext|>' is id 0 in the data and id 299 in this tokenizer" in f["message"]


def test_a_mixture_source_made_with_another_tokenizer_is_named(made, tmp_path):
    root, tok_a, tok_b = made
    data = {"train": [{"name": "x", "path": str(root / "src_x" / "train"), "weight": 1.0}]}
    ok, _ = plan_json(root, tmp_path, tok_a, data)
    assert finding(ok, "C-TOK-007") is None
    doc, rc = plan_json(root, tmp_path, tok_b, data)
    f = finding(doc, "C-TOK-007")
    assert rc == 1 and f is not None and "the source 'x' data was made with another tokenizer" in f["message"]
