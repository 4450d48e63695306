"""Byte-level BPE and character tokenizers made with Hugging Face `tokenizers`, and loading any tokenizer.json."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from apr.errors import AprError, Finding
from apr.fsutil import atomic_write_text
from apr.readers import read_text

EOT = "<|endoftext|>"
# End-of-text tokens recognised by name when --eot-token is not given, most specific first: ours,
# then the names other tokenizer families use for the token that ends a document.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


MAX_VOCAB_SIZE = 2**32  # token ids are uint32 in shards and caches

def train_tokenizer(documents: Iterable[str], vocab_size: int, out: str | Path,
                    special_tokens: list[str] | None = None, min_frequency: int = 2,
                    show_progress: bool = False) -> dict:
    """Train a byte-level BPE tokenizer on ``documents`` and write it atomically to ``out``.

    The end-of-text token ``<|endoftext|>`` always comes first (id 0); ``special_tokens`` are
    added after it. Training is deterministic: the same documents give a byte-identical file.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = [EOT] + [t for t in dict.fromkeys(special_tokens or []) if t != EOT]
    if vocab_size < 256 + len(specials):
        raise AprError(f"--vocab-size {vocab_size} is too small", [Finding(
            "error", "data.vocab_size", "a byte-level BPE needs the 256 byte tokens plus the special tokens",
            path="--vocab-size", expected=f"at least {256 + len(specials)}", got=str(vocab_size))])
    if vocab_size > MAX_VOCAB_SIZE:
        raise AprError(f"--vocab-size {vocab_size:,} is too large", [Finding(
            "error", "data.vocab_size", "token ids are stored as uint32", path="--vocab-size",
            expected=f"at most {MAX_VOCAB_SIZE:,}", got=f"{vocab_size:,}")])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    stats = {"documents": 0, "chars": 0}

    def counted():
        for doc in documents:
            if doc:
                stats["documents"] += 1
                stats["chars"] += len(doc)
                yield doc

    tok.train_from_iterator(counted(), trainer=trainer)
    if stats["chars"] == 0:
        raise AprError("the input holds no text to train on", [Finding(
            "error", "data.empty", "every input document is empty", expected="some text", got="0 characters")])
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, tok.to_str(pretty=True))
    except OSError as e:
        raise AprError(f"cannot write {out}: {e.strerror}", [Finding(
            "error", "data.output", f"cannot write: {e.strerror}", file=str(out))]) from None
    return {"path": str(out), "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "requested_vocab_size": vocab_size, "special_tokens": specials, "documents": stats["documents"],
            "chars": stats["chars"], "sha256": file_sha256(out)}


UNK = "<|unk|>"  # a character tokenizer's id for a character its vocabulary lacks


def train_char_tokenizer(documents: Iterable[str], vocab_size: int | None, out: str | Path,
                         special_tokens: list[str] | None = None) -> dict:
    """Write a character tokenizer (one token per Unicode character, as DantinoX's ``char``) to
    ``out``: ``<|endoftext|>`` (id 0), ``<|unk|>`` (1), the extra ``special_tokens``, then the
    characters of ``documents``, most frequent first (ties by code point), at most ``vocab_size``
    ids in all (None: every character seen); a character left out encodes as ``<|unk|>``. An
    ordinary tokenizer.json (a WordLevel model over a one-character split), so everything that
    reads tokenizers reads it; deterministic: the same documents give a byte-identical file."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = [EOT, UNK] + [t for t in dict.fromkeys(special_tokens or []) if t not in (EOT, UNK)]
    if vocab_size is not None and vocab_size <= len(specials):
        raise AprError(f"--vocab-size {vocab_size} is too small", [Finding(
            "error", "data.vocab_size", "a character tokenizer needs its special tokens and at least one character",
            path="--vocab-size", expected=f"at least {len(specials) + 1}", got=str(vocab_size))])
    counts: dict[str, int] = {}
    documents_seen = chars = 0
    for doc in documents:
        if doc:
            documents_seen += 1
            chars += len(doc)
            for ch in doc:
                counts[ch] = counts.get(ch, 0) + 1
    if chars == 0:
        raise AprError("the input holds no text to train on", [Finding(
            "error", "data.empty", "every input document is empty", expected="some text", got="0 characters")])
    ranked = [ch for ch in sorted(counts, key=lambda c: (-counts[c], ord(c))) if ch not in specials]
    keep = ranked if vocab_size is None else ranked[:vocab_size - len(specials)]
    vocab = {tok: i for i, tok in enumerate(specials + keep)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, tok.to_str(pretty=True))
    except OSError as e:
        raise AprError(f"cannot write {out}: {e.strerror}", [Finding(
            "error", "data.output", f"cannot write: {e.strerror}", file=str(out))]) from None
    return {"path": str(out), "vocab_size": len(vocab), "requested_vocab_size": vocab_size or len(vocab),
            "special_tokens": specials, "documents": documents_seen, "chars": chars,
            "unknown_chars": len(ranked) - len(keep), "sha256": file_sha256(out)}


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json; AprError naming the file when it cannot load."""
    from tokenizers import Tokenizer

    path = Path(path)
    text = read_text(path, "tokenizer", "tokenizer", error=AprError)  # bounded: size, FIFOs, devices
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises plain Exception with a serde message, or OSError
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise AprError(f"cannot load tokenizer {path}", [Finding(
            "error", "data.tokenizer", f"not a loadable tokenizer.json: {first}", file=str(path),
            expected="a Hugging Face tokenizer.json")]) from None


def find_eot(tok, path: str | Path, name: str | None = None) -> tuple[str, int]:
    """The end-of-text token that separates documents: ``name`` if given, else the first of
    ``EOT_CANDIDATES`` the vocabulary holds."""
    names = (name,) if name else EOT_CANDIDATES
    for candidate in names:
        token_id = tok.token_to_id(candidate)
        if token_id is not None:
            return candidate, int(token_id)
    raise AprError(f"tokenizer {path} has no end-of-text token", [Finding(
        "error", "data.tokenizer", f"the vocabulary has no {' or '.join(names)}"
        + ("" if name else " (name one with --eot-token)"), file=str(path),
        expected="an end-of-text token", got="none")])


def splits_at_newlines(tok) -> bool:
    """Whether cutting a document after a newline that sits between two non-space characters leaves
    its token ids unchanged: true for a byte-level BPE with the GPT-2 split regex, no normaliser and
    no post-processor (what ``train_tokenizer`` makes). Such a newline always ends a pre-token and
    the next pre-token starts afresh, so long documents can be encoded in parallel pieces."""
    try:
        spec = json.loads(tok.to_str())
    except Exception:
        return False
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and spec.get("post_processor") in (None, {})
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False) and (spec.get("model") or {}).get("type") == "BPE")


def file_sha256(path: str | Path, on_chunk: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return h.hexdigest()
