"""Turn a contract's example into real files: a config, Parquet shards and a tokenizer.

Every contract file carries examples (``expect: pass`` or ``expect: fail``). An example is an
overlay on ``BASE_CONFIG`` plus a description of the inputs; ``materialize`` writes them into a
folder so that the example goes through the same ``build_plan`` as a user's run. The base scenario
passes every error and warning contract, so a failing example fails because of what it changes.

Example keys (all optional but ``expect``):

``config``     mapping deep-merged over BASE_CONFIG (a null value sets the key to null)
``train``      shards: rows, shards, row_len (default seq_len + 1), max_token, column, dtype
               (uint32, int64, float32, string), list (false: a plain column), statistics, ragged,
               missing (path absent), empty (folder without shards), corrupt (one shard is not Parquet),
               manifest (``same``: a pretokenize manifest.json naming the example's tokenizer; ``other``:
               naming another tokenizer's sha256), eot_id (the manifest's end-of-text id, default 0)
``val``        the same keys, or ``same_as_train: true`` / ``copy_of_train: true``
``tokenizer``  vocab_size (default: the config's), added_tokens, missing, corrupt
``target``     gpu / vram, as on the command line;  ``world_size``: as --world-size
``message_contains``  substrings the finding's message must contain (failing examples)
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

BASE_CONFIG: dict = {
    "model": {"architecture": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 192, "vocab_size": 512, "max_position_embeddings": 64}},
    "data": {"train": "train/", "val": "val/", "batch_size": 2, "seq_len": 32, "tokenizer": "tokenizer.json"},
    "optimizer": {"lr": 3.0e-4},
    "training": {"epochs": 1, "max_steps": 20, "warmup_steps": 2, "save_interval": 10, "eval_interval": 10,
                 "device": "cpu", "output_dir": "run/"},
}
BASE_TRAIN = {"rows": 64, "shards": 2}
BASE_VAL = {"rows": 16, "shards": 1}


def deep_merge(base: dict, overlay: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def write_shards(folder: Path, *, rows: int, row_len: int, max_token: int, shards: int = 1,
                 column: str = "input_ids", dtype: str = "uint32", as_list: bool = True,
                 statistics: bool = True, ragged: bool = False, seed: int = 0) -> list[Path]:
    """Write ``rows`` rows of ``row_len`` token ids (the largest is ``max_token``) into ``shards`` files."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    per = [rows // shards + (1 if i < rows % shards else 0) for i in range(shards)]
    for i, n in enumerate(per):
        lengths = np.full(n, row_len, dtype=np.int64)
        if ragged and n > 1:
            lengths[::2] += 1
            lengths[1::2] -= 1
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        total = int(offsets[-1])
        rng = np.random.default_rng(seed + i)
        flat = rng.integers(0, max_token + 1, size=total, dtype=np.int64)
        if total:
            flat[0] = max_token
        if dtype == "string":
            values = pa.array([str(v) for v in flat], pa.string())
        else:
            values = pa.array(flat.astype(dtype))
        col = pa.ListArray.from_arrays(pa.array(offsets), values) if as_list else values[:n]
        path = folder / f"shard-{i:05d}.parquet"
        pq.write_table(pa.table({column: col}), path, write_statistics=statistics)
        paths.append(path)
    return paths


def write_tokenizer(path: Path, vocab_size: int, added_tokens: int = 0) -> Path:
    """A word-level tokenizer.json whose vocabulary (with added tokens) has vocab_size + added_tokens."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    if added_tokens:
        tok.add_special_tokens([AddedToken(f"<extra_{i}>", special=True) for i in range(added_tokens)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _write_dataset(folder: Path, spec: dict, config: dict, default_max: int, seed: int) -> None:
    if spec.get("missing"):
        return
    folder.mkdir(parents=True, exist_ok=True)
    if spec.get("empty"):
        (folder / "README.txt").write_text("no shards here\n")
        return
    seq_len = config["data"]["seq_len"]
    write_shards(folder, rows=spec.get("rows", 16), row_len=spec.get("row_len", seq_len + 1),
                 max_token=spec.get("max_token", default_max), shards=spec.get("shards", 1),
                 column=spec.get("column", config["data"].get("input_column", "input_ids")),
                 dtype=spec.get("dtype", "uint32"), as_list=spec.get("list", True),
                 statistics=spec.get("statistics", True), ragged=spec.get("ragged", False), seed=seed)
    if spec.get("corrupt"):
        (folder / "shard-99999.parquet").write_bytes(b"this is not a parquet file\n")


def _write_manifest(folder: Path, spec: dict, tokenizer: str | None) -> None:
    """A pretokenize manifest.json beside the shards, naming the example's tokenizer (``same``) or
    another one (``other``), with ``<unk>`` as the end-of-text token."""
    if spec["manifest"] == "same" and tokenizer is not None and Path(tokenizer).is_file():
        sha = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    else:
        sha = "0" * 64
    doc = {"tokenizer": {"path": "other-tokenizer.json", "sha256": sha, "eot_token": "<unk>",
                         "eot_id": spec.get("eot_id", 0)}}
    (folder / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")


def materialize(example: dict, folder: Path) -> tuple[Path, dict]:
    """Write the example's config and inputs under ``folder``.

    Returns the config path and the keyword arguments for ``build_plan`` (gpu, vram, world_size).
    """
    folder.mkdir(parents=True, exist_ok=True)
    config = deep_merge(BASE_CONFIG, example.get("config") or {})
    data = config["data"]
    for key in ("train", "val", "tokenizer"):
        if data.get(key) is not None and not Path(data[key]).is_absolute():
            data[key] = str(folder / data[key])

    tok_spec = {"vocab_size": config["model"]["architecture"]["vocab_size"], **(example.get("tokenizer") or {})}
    tok_vocab = tok_spec["vocab_size"] + tok_spec.get("added_tokens", 0)
    default_max = min(config["model"]["architecture"]["vocab_size"], tok_vocab) - 1

    train_spec = {**BASE_TRAIN, **(example.get("train") or {})}
    _write_dataset(Path(data["train"]), train_spec, config, default_max, seed=0)
    if data.get("val") is not None:
        val_spec = {**BASE_VAL, **(example.get("val") or {})}
        if val_spec.get("same_as_train"):
            data["val"] = data["train"]
        elif val_spec.get("copy_of_train"):
            shutil.rmtree(data["val"], ignore_errors=True)
            shutil.copytree(data["train"], data["val"])
        else:
            _write_dataset(Path(data["val"]), val_spec, config, default_max, seed=1000)
    if data.get("tokenizer") is not None and not tok_spec.get("missing"):
        path = Path(data["tokenizer"])
        if tok_spec.get("corrupt"):
            path.write_text("{ not a tokenizer")
        else:
            write_tokenizer(path, tok_spec["vocab_size"], tok_spec.get("added_tokens", 0))
    for key, spec in (("train", train_spec), ("val", val_spec if data.get("val") is not None else {})):
        if spec.get("manifest"):
            _write_manifest(Path(data[key]), spec, data.get("tokenizer"))

    config_path = folder / "config.yaml"
    config_path.write_text(to_yaml(config))
    kwargs: dict[str, Any] = {k: v for k, v in (example.get("target") or {}).items() if k in ("gpu", "vram")}
    if example.get("world_size") is not None:
        kwargs["world_size"] = example["world_size"]
    return config_path, kwargs


def to_yaml(doc: dict) -> str:
    """Block-style YAML, so findings point at one key per line."""

    from ruamel.yaml import YAML

    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    buf = io.StringIO()
    yaml.dump(json.loads(json.dumps(doc)), buf)
    return buf.getvalue()
