"""Checkpoints written in parts, one per rank, by sharded runs (``training.sharding``; docs/checkpoints.md,
"Sharded checkpoints").

Each rank writes ``<stem>.part-R-of-K.safetensors``: its rows of every tensor (weights and both AdamW
moments, the same names as a whole checkpoint; FSDP2 splits every tensor along its first dimension
in rank order, so the whole tensor is the parts' rows concatenated). Rank 0 then writes the JSON
sidecar, last, naming every part with its size and SHA-256 (``weights_parts``, format version 2):
a part without that JSON, or whose bytes do not match it, never makes a checkpoint look complete.
``weights_file`` names part 0, ``weights_size`` is the parts' total and ``weights_sha256`` the
SHA-256 of their digests joined by newlines (one digest for the run registry and ``apr runs``).

Readers get whole tensors (``load``): export, generate, evaluation and a resume on any number of
ranks see what a single-file checkpoint gives them.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from apr.checkpoint import files

PART_RE = re.compile(r"^(checkpoint-(?:step-\d+|best))\.part-(\d+)-of-(\d+)\.safetensors$")


def part_name(stem: str, rank: int, world: int) -> str:
    return f"{stem}.part-{rank}-of-{world}.safetensors"


def parts_of(folder: Path, stem: str) -> list[Path]:
    """The part files of ``stem`` present in ``folder`` (any number of parts), in name order."""
    try:
        names = [p.name for p in folder.iterdir()]
    except FileNotFoundError:
        return []
    return sorted(folder / n for n in names if (m := PART_RE.match(n)) and m.group(1) == stem)


def index_digest(shas: list[str]) -> str:
    """One digest for the whole checkpoint: the SHA-256 of the parts' digests, one per line, in order."""
    return hashlib.sha256("\n".join(shas).encode("ascii")).hexdigest()


def merged_shapes(headers: list[dict], names: list[str]) -> tuple[dict, dict, list[str]]:
    """The whole tensors' shapes and dtypes from the parts' headers (rows add up along the first
    dimension; the other dimensions and the dtype must agree), and what does not fit that."""
    shapes: dict[str, tuple] = {}
    dtypes: dict[str, str] = {}
    problems: list[str] = []
    tensor_names = [n for n in headers[0] if n != "__metadata__"]
    for part, header in zip(names, headers, strict=True):
        if sorted(n for n in header if n != "__metadata__") != sorted(tensor_names):
            problems.append(f"{part} holds other tensors than {names[0]}")
    for name in tensor_names:
        entries = [h.get(name) for h in headers]
        try:
            first = entries[0]
            rows = sum(int(e["shape"][0]) for e in entries)
            if any(tuple(e["shape"][1:]) != tuple(first["shape"][1:]) or e["dtype"] != first["dtype"]
                   for e in entries):
                problems.append(f"{name}: the parts disagree on its shape or dtype")
                continue
        except (TypeError, KeyError, IndexError, ValueError):
            problems.append(f"{name}: a part has no usable header entry for it")
            continue
        shapes[name] = (rows, *first["shape"][1:])
        dtypes[name] = first["dtype"]
    return shapes, dtypes, problems


def load(paths: list[Path], keep) -> dict[str, Any]:
    """Whole tensors (CPU) assembled from the parts, for the names ``keep(name)`` accepts."""
    import torch
    from safetensors import safe_open

    handles = [safe_open(str(p), framework="pt") for p in paths]
    try:
        out = {}
        for name in handles[0].keys():
            if keep(name):
                out[name] = torch.cat([h.get_tensor(name) for h in handles], dim=0)
        return out
    finally:
        del handles


def write_part(path: Path, tensors: dict[str, Any], step: int, rank: int, world: int) -> tuple[str, int]:
    """This rank's part, atomically (temp file, fsync, rename). Returns (SHA-256, size)."""
    return files.write_safetensors(path, tensors, metadata={
        "format": "apr-checkpoint-part", "step": str(step), "part": str(rank), "parts": str(world)})
