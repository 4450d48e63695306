"""Tokenize documents in parallel, pack them into rows of ``seq_len + 1`` tokens, write shards.

The pipeline streams, so memory stays bounded by a few batches whatever the corpus size:

1. a reader thread reads the inputs in order and groups documents into batches of about
   ``BATCH_CHARS`` characters (a long document is cut into pieces where that provably does not
   change its tokens, see ``tokenizer.splits_at_newlines``, so one big file still keeps every
   core busy);
2. the calling thread encodes each batch with the tokenizer's batch encoder, which runs on all
   cores in Rust with the GIL released, so reading the next batch overlaps with it;
3. the ids of each document are followed by the end-of-text token and appended to one stream,
   which is cut into rows of ``seq_len + 1`` tokens (a row's inputs are its first ``seq_len``
   tokens and its targets the last ``seq_len``); the tail that does not fill a row is dropped;
4. rows are dealt into train and val in blocks of ``SPLIT_BLOCK`` rows: in block ``b`` a
   choice seeded by ``(seed, b)`` sends ``round(SPLIT_BLOCK * val_fraction)`` rows to val;
5. ``shards.DatasetWriter`` writes full shards as they fill, then the manifest, then renames.

Same inputs, tokenizer, options and seed give byte-identical shards and manifest.
"""

from __future__ import annotations

import queue
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from apr import __version__
from apr.data.corpus import source_name
from apr.data.shards import DatasetWriter, check_destination
from apr.data.sources import expand_inputs, input_bytes, read_documents
from apr.data.tokenizer import file_sha256, find_eot, load_tokenizer, splits_at_newlines
from apr.errors import AprError, Finding

BATCH_CHARS = 1 << 20  # characters per call of the batch encoder
PIECE_CHARS = 1 << 16  # long documents are encoded in pieces of about this many characters
SPLIT_BLOCK = 1024  # rows per block of the train/val split
# A newline between two non-space characters: a pre-token boundary of the GPT-2 split regex.
_CUT = re.compile(r"(?<=\S)\n(?=\S)")

Progress = Callable[[int, int, int], None]  # (input bytes done, input bytes in all, tokens so far)


def document_pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """``text`` cut after newlines that sit between non-space characters, into pieces of at least
    ``piece_chars`` characters (except the last); joined, they give ``text`` back."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        m = _CUT.search(text, start + piece_chars)
        if m is None:
            break
        pieces.append(text[start:m.end()])
        start = m.end()
    pieces.append(text[start:])
    return pieces


class _Reader(threading.Thread):
    """Reads documents into batches ``(texts, ends_document)`` on a bounded queue, in order."""

    def __init__(self, files: list[Path], text_key: str, text_column: str, cut_long: bool):
        super().__init__(daemon=True, name="apr-pretokenize-reader")
        self.files, self.text_key, self.text_column, self.cut_long = files, text_key, text_column, cut_long
        self.queue: queue.Queue = queue.Queue(maxsize=4)
        self.stop = threading.Event()
        self.bytes_read = 0
        self.documents: list[int] = [0] * len(files)

    def _count(self, n: int) -> None:
        self.bytes_read += n

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        texts: list[str] = []
        ends: list[bool] = []
        chars = 0
        try:
            for i, path in enumerate(self.files):
                for doc in read_documents(path, self.text_key, self.text_column, self._count):
                    self.documents[i] += 1
                    pieces = document_pieces(doc, PIECE_CHARS) if self.cut_long and len(doc) > PIECE_CHARS else [doc]
                    for j, piece in enumerate(pieces):
                        texts.append(piece)
                        ends.append(j == len(pieces) - 1)
                        chars += len(piece)
                        if chars >= BATCH_CHARS:
                            if not self._put(("batch", texts, ends)):
                                return
                            texts, ends, chars = [], [], 0
            if texts and not self._put(("batch", texts, ends)):
                return
            self._put(("done", None, None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(("error", e, None))

    def batches(self) -> Iterator[tuple[list[str], list[bool]]]:
        self.start()
        try:
            while True:
                kind, texts, ends = self.queue.get()
                if kind == "done":
                    return
                if kind == "error":
                    raise texts
                yield texts, ends
        finally:
            self.stop.set()


class _Splitter:
    """Deals packed rows into train and val, one block of ``SPLIT_BLOCK`` rows at a time."""

    def __init__(self, writer: DatasetWriter, val_fraction: float, seed: int):
        self.writer, self.val_fraction, self.seed = writer, val_fraction, seed
        self.block: list[np.ndarray] = []
        self.block_rows = 0
        self.blocks = 0
        self.val_rows = 0
        self.train_rows = 0
        writer.add("train", np.empty((0, 0), np.uint32))
        if val_fraction > 0:
            writer.add("val", np.empty((0, 0), np.uint32))

    def add(self, rows: np.ndarray) -> None:
        while len(rows):
            take = min(SPLIT_BLOCK - self.block_rows, len(rows))
            self.block.append(rows[:take])
            self.block_rows += take
            rows = rows[take:]
            if self.block_rows == SPLIT_BLOCK:
                self._deal(last=False)

    def _deal(self, last: bool) -> None:
        block = self.block[0] if len(self.block) == 1 else np.concatenate(self.block)
        n = len(block)
        k = int(round(n * self.val_fraction))
        if last and self.val_fraction > 0 and self.val_rows + k == 0 and self.train_rows + n > 1:
            k = 1  # a val split was asked for: never leave it empty when there are two rows
        mask = np.zeros(n, dtype=bool)
        if k:
            mask[np.random.default_rng([self.seed % 2**64, self.blocks]).choice(n, size=k, replace=False)] = True
            self.writer.add("val", block[mask])
        self.writer.add("train", block[~mask])
        self.val_rows += k
        self.train_rows += n - k
        self.blocks += 1
        self.block, self.block_rows = [], 0

    def finish(self) -> None:
        if self.block_rows:
            self._deal(last=True)


def _check_options(seq_len: int, val_fraction: float) -> None:
    if seq_len < 1:
        raise AprError(f"--seq-len must be at least 1, got {seq_len}", [Finding(
            "error", "data.seq_len", "rows need at least one predicted token", path="--seq-len",
            expected=">= 1", got=str(seq_len))])
    if not 0.0 <= val_fraction < 1.0:
        raise AprError(f"--val-fraction must be in [0, 1), got {val_fraction}", [Finding(
            "error", "data.val_fraction", "the share of rows held out for validation", path="--val-fraction",
            expected="0 <= F < 1", got=str(val_fraction))])


def pretokenize(inputs: list[str | Path], tokenizer_path: str | Path, seq_len: int, out: str | Path, *,
                val_fraction: float = 0.0, shard_rows: int = 4096, seed: int = 0, glob: str | None = None,
                text_key: str = "text", text_column: str = "text", column: str = "input_ids",
                eot_token: str | None = None, overwrite: bool = False, progress: Progress | None = None) -> dict:
    """Tokenize ``inputs`` (files, or folders expanded with ``glob``), pack, split, and write the
    shards and manifest to ``out``; return the manifest."""
    import tokenizers

    files = expand_inputs(inputs, glob)
    tokenizer_path = Path(tokenizer_path)
    _check_options(seq_len, val_fraction)
    # before any work: fail fast on an existing --out, or one that would swallow an input
    check_destination(Path(out), overwrite, [Path(p) for p in inputs if isinstance(p, str | Path)] + [tokenizer_path])
    tok = load_tokenizer(tokenizer_path)
    eot, eot_id = find_eot(tok, tokenizer_path, eot_token)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    eot_arr = np.array([eot_id], dtype=np.uint32)
    width = seq_len + 1
    total_bytes = input_bytes(files)
    reader = _Reader(files, text_key, text_column, cut_long=splits_at_newlines(tok))
    tokens = 0
    carry = np.empty(0, dtype=np.uint32)

    def encoded(texts: list[str], ends: list[bool]) -> np.ndarray:
        """One batch's ids, each document's followed by the end-of-text id."""
        pieces = []
        for enc, end in zip(encode(texts, add_special_tokens=False), ends, strict=True):
            pieces.append(np.asarray(enc.ids, dtype=np.uint32))
            if end:
                pieces.append(eot_arr)
        return np.concatenate(pieces)

    def pack(batch: np.ndarray) -> None:
        """Append a batch to the stream and hand the whole rows to the splitter."""
        nonlocal carry, tokens
        stream = np.concatenate([carry, batch])
        tokens += len(batch)
        n = len(stream) // width
        if n:
            splitter.add(stream[: n * width].reshape(n, width))
        carry = stream[n * width:].copy()
        if progress is not None:
            progress(reader.bytes_read, total_bytes, tokens)

    with DatasetWriter(out, shard_rows, column, overwrite) as writer, ThreadPoolExecutor(2) as pool:
        splitter = _Splitter(writer, val_fraction, seed)
        # Two batches encode at once (the GIL is released; they share the encoder's threads, so no
        # core idles while one batch waits on its longest document) while this thread packs and
        # writes the batch before them. Results are taken in order: the output does not change.
        in_flight: deque[Future] = deque()
        try:
            for texts, ends in reader.batches():
                in_flight.append(pool.submit(encoded, texts, ends))
                if len(in_flight) > 2:
                    pack(in_flight.popleft().result())
            while in_flight:
                pack(in_flight.popleft().result())
        finally:
            reader.stop.set()  # on an error here, the reader thread must not wait on a full queue
            for future in in_flight:
                future.cancel()
        documents = sum(reader.documents)
        if documents == 0:
            where = str(files[0]) if len(files) == 1 else f"the {len(files)} inputs"
            raise AprError(f"{where}: no text", [Finding(
                "error", "data.empty", "the input holds no non-empty document",
                file=str(files[0]) if len(files) == 1 else None, expected="some text", got="nothing")])
        splitter.finish()
        if splitter.train_rows + splitter.val_rows == 0:
            raise AprError(f"too little text for one row of {width} tokens", [Finding(
                "error", "data.too_small", f"{documents} documents give {tokens} tokens",
                path="--seq-len", expected=f"at least {width} tokens (seq_len + 1)", got=f"{tokens} tokens")])
        if splitter.train_rows == 0:
            raise AprError("--val-fraction leaves no training rows", [Finding(
                "error", "data.val_fraction", f"{splitter.val_rows} rows in all went to val",
                path="--val-fraction", expected="at least one training row", got="0")])
        manifest = {
            "created_by": f"apr {__version__} (tokenizers {tokenizers.__version__})",
            "seq_len": seq_len,
            "row_len": width,
            "tokenizer": {"path": str(tokenizer_path), "sha256": file_sha256(tokenizer_path),
                          "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                          "eot_token": eot, "eot_id": eot_id},
            "documents": documents,
            "tokens_total": tokens,
            "tokens_dropped": int(len(carry)),
            "val_fraction": val_fraction,
            "seed": seed,
            "split_block": SPLIT_BLOCK,
            "sources": [{"path": source_name(f), "bytes": f.stat().st_size, "documents": d}
                        for f, d in zip(files, reader.documents, strict=True)],
        }
        return writer.commit(manifest)

