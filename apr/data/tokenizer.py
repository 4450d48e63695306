"""Byte-level BPE tokenizers trained with Hugging Face `tokenizers`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from apr.errors import AprError, Finding

EOT = "<|endoftext|>"


def train_tokenizer(documents, vocab_size: int, out: Path, special_tokens: list[str] | None = None,
                    min_frequency: int = 2) -> dict:
    """Train a byte-level BPE tokenizer on ``documents`` (an iterable of str) and save it to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = list(special_tokens or [EOT])
    if vocab_size < 256 + len(specials):
        raise AprError(f"--vocab-size {vocab_size} is too small", [Finding(
            "error", "data.vocab_size", "a byte-level BPE needs the 256 byte tokens plus the special tokens",
            expected=f"at least {256 + len(specials)}", got=str(vocab_size))])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs = list(documents)
    if not any(d.strip() for d in docs):
        raise AprError("the input holds no text to train on", [Finding("error", "data.empty",
                                                                       "all documents are empty")])
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "path": str(out),
            "special_tokens": specials, "sha256": file_sha256(out)}


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise AprError(f"tokenizer not found: {path}", [Finding("error", "data.tokenizer", "no such file",
                                                                 file=str(path), expected="a tokenizer.json")])
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise AprError(f"cannot load tokenizer {path}", [Finding(
            "error", "data.tokenizer", f"not a tokenizers JSON file: {str(e).splitlines()[0][:200]}",
            file=str(path), expected="a Hugging Face tokenizer.json")]) from None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
