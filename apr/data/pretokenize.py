"""Tokenize documents in parallel, pack them into rows of seq_len + 1 tokens, write Parquet shards."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from apr.data.shards import write_dataset
from apr.data.tokenizer import EOT, file_sha256, load_tokenizer
from apr.errors import AprError, Finding

BATCH_DOCS = 256


def encode_documents(tokenizer, documents, eot_id: int, progress: bool = False) -> np.ndarray:
    """All documents' ids joined by the end-of-text token, as one uint32 array."""
    pieces: list[np.ndarray] = []
    eot = np.array([eot_id], dtype=np.uint32)
    batch: list[str] = []
    n_docs = 0

    def flush():
        for enc in tokenizer.encode_batch_fast(batch) if hasattr(tokenizer, "encode_batch_fast") \
                else tokenizer.encode_batch(batch):
            pieces.append(np.asarray(enc.ids, dtype=np.uint32))
            pieces.append(eot)
        batch.clear()

    for doc in documents:
        if not doc:
            continue
        batch.append(doc)
        n_docs += 1
        if len(batch) >= BATCH_DOCS:
            flush()
            if progress:
                print(f"\r  tokenized {n_docs} documents", end="", file=sys.stderr, flush=True)
    if batch:
        flush()
    if progress:
        print(f"\r  tokenized {n_docs} documents", file=sys.stderr)
    if not pieces:
        raise AprError("the input holds no text", [Finding("error", "data.empty", "no non-empty document found")])
    return np.concatenate(pieces)


def pack_rows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut the token stream into rows of seq_len + 1 tokens (inputs and shifted targets); drop the tail."""
    width = seq_len + 1
    n = len(ids) // width
    if n == 0:
        raise AprError("too little text for one row", [Finding(
            "error", "data.too_small", f"the corpus has {len(ids)} tokens", expected=f"at least {width} tokens",
            got=str(len(ids)))])
    return ids[: n * width].reshape(n, width)


def split_rows(rows: np.ndarray, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Deterministic train/val split: a seeded choice of whole rows goes to val."""
    n_val = int(round(len(rows) * val_fraction))
    if val_fraction > 0 and n_val == 0 and len(rows) > 1:
        n_val = 1
    if n_val >= len(rows) and n_val > 0:
        raise AprError("--val-fraction leaves no training rows", [Finding(
            "error", "data.val_fraction", f"{len(rows)} rows in all", expected="fewer val rows than rows",
            got=str(n_val))])
    order = np.random.default_rng(seed).permutation(len(rows))
    val_idx = np.sort(order[:n_val])
    mask = np.ones(len(rows), dtype=bool)
    mask[val_idx] = False
    splits = {"train": rows[mask]}
    if n_val:
        splits["val"] = rows[val_idx]
    return splits


def pretokenize(documents, sources: list[str], tokenizer_path: Path, seq_len: int, out: Path,
                val_fraction: float = 0.0, shard_rows: int = 4096, seed: int = 0, column: str = "input_ids",
                progress: bool = False) -> dict:
    """Tokenize, pack, split and write shards; return the manifest."""
    tok = load_tokenizer(tokenizer_path)
    eot_id = tok.token_to_id(EOT)
    if eot_id is None:
        raise AprError(f"tokenizer {tokenizer_path} has no {EOT} token", [Finding(
            "error", "data.tokenizer", f"missing special token {EOT}", file=str(tokenizer_path),
            expected=f"{EOT} in the vocabulary")])
    ids = encode_documents(tok, documents, eot_id, progress)
    rows = pack_rows(ids, seq_len)
    splits = split_rows(rows, val_fraction, seed)
    manifest = {
        "seq_len": seq_len, "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "tokenizer": str(tokenizer_path), "tokenizer_sha256": file_sha256(tokenizer_path),
        "eot_id": int(eot_id), "tokens_total": int(len(ids)), "tokens_dropped": int(len(ids) - rows.size),
        "seed": seed, "val_fraction": val_fraction, "sources": sources,
    }
    return write_dataset(out, splits, manifest, shard_rows, column)
