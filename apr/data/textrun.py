"""Everything a run needs from one text file (`apr train text FILE`, docs/data.md, "Training
straight from a text file"): a tokenizer trained on the file (a character tokenizer by default, or
a byte-level BPE), the file pretokenized into train and val shards, and a config for a small model
over them, written under one folder. The same data commands' functions (apr/data/tokenizer.py,
apr/data/pretokenize.py) do the work; no network.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML

from apr.data.pretokenize import pretokenize
from apr.data.sources import iter_documents
from apr.data.tokenizer import train_char_tokenizer, train_tokenizer
from apr.errors import AprError, Finding
from apr.fsutil import atomic_write_text, check_output_folder

# the model a text run trains: about 0.8M parameters plus the embedding, minutes on a CPU
SMALL_MODEL = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 384}


@dataclass
class TextRun:
    config: Path  # the written config.yaml
    tokenizer: Path
    vocab_size: int  # the tokenizer's ids (the model's vocab_size is this rounded up to 64)
    train_rows: int
    val_rows: int


def prepare_text_run(text: Path, out: Path, *, kind: str = "char", vocab_size: int | None = None,
                     seq_len: int = 128, batch_size: int = 16, val_fraction: float = 0.05, seed: int = 0,
                     max_steps: int | None = None, overwrite: bool = False) -> TextRun:
    """Write ``out/tokenizer.json``, ``out/data/{train,val}`` and ``out/config.yaml`` (its run in
    ``out/run``: ``max_steps`` steps, or one pass over the text) from the text file ``text``;
    AprError when it is too short to fill one training row (pretokenize's, or naming the file when
    every row went to val)."""
    out = check_output_folder(out, inputs=[text], option="--out")  # a file, FIFO, device, link, apr's records
    if not Path(text).is_file():
        raise AprError(f"{text} is not a file", [Finding("error", "data.input", "no such text file", file=str(text),
                                                         expected="a text file", got="nothing")])
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise AprError(f"{out} already exists and is not empty; pass --overwrite to replace what it holds",
                       [Finding("error", "data.output", "output folder not empty", file=str(out),
                                expected="a new or empty folder", got="a folder with files")])
    tok_path = out / "tokenizer.json"
    documents = iter_documents([Path(text)], "text", "text")
    if kind == "char":
        info = train_char_tokenizer(documents, vocab_size, tok_path)
    else:
        info = train_tokenizer(documents, vocab_size or 4096, tok_path)
    manifest = pretokenize([Path(text)], tok_path, seq_len, out / "data", val_fraction=val_fraction, seed=seed,
                           overwrite=True)
    rows = {name: split["rows"] for name, split in manifest["splits"].items()}
    if not rows.get("train"):
        raise AprError(f"{text} is too short: it fills no training row of seq_len + 1 = {seq_len + 1} tokens",
                       [Finding("error", "data.too_short", "no training row", file=str(text),
                                expected=f"at least {seq_len + 1} tokens (--seq-len smaller, or more text)",
                                got=f"{manifest['tokens_total']} tokens")])
    vocab, batch = info["vocab_size"], min(batch_size, rows["train"])
    steps = max_steps or max(rows["train"] // batch, 1)
    data = {"train": str((out / "data" / "train").resolve()), "seq_len": seq_len,
            "batch_size": batch, "tokenizer": str(tok_path.resolve())}
    if rows.get("val"):
        data["val"] = str((out / "data" / "val").resolve())
    config = {
        "model": {"architecture": {**SMALL_MODEL, "vocab_size": -(-vocab // 64) * 64,
                                   "max_position_embeddings": seq_len}},
        "data": data,
        "optimizer": {"lr": 1e-3},
        "training": {"output_dir": str((out / "run").resolve()), "seed": seed, "warmup_steps": min(10, steps // 10),
                     "save_interval": 100, "epochs": -(-steps * batch // rows["train"]),
                     **({"max_steps": max_steps} if max_steps else {}),
                     "eval_interval": 50 if rows.get("val") else 0, "eval_batches": 4, "log_interval": 10},
    }
    yaml, text_out = YAML(typ="safe", pure=True), io.StringIO()
    yaml.default_flow_style = False
    yaml.dump(config, text_out)
    path = out / "config.yaml"
    atomic_write_text(path, f"# written by apr train text from {Path(text).resolve()}\n" + text_out.getvalue())
    return TextRun(path, tok_path, vocab, rows["train"], rows.get("val", 0))
