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
from collections.abc import Mapping
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
    lazy = LazyTensors(paths, keep)
    return {name: lazy[name] for name in lazy}


class LazyTensors(Mapping):
    """A checkpoint's tensors read when asked, from its weights file or its parts (each file holds
    consecutive rows of every tensor): ``lazy[name]`` is the whole tensor, ``rows(name, start,
    stop)`` reads only the files, and the rows of them, that overlap those rows. A sharded resume
    reads each rank's rows this way (apr/train/sharded.py), so no process holds the whole model.
    Names, shapes and dtypes come from the files' headers (torch-free: a plan reads them); the files
    are mapped with safetensors on the first read. Raises ValueError when the files' headers do not
    make one set of tensors."""

    def __init__(self, paths: list[Path], keep=lambda name: True):
        self._paths = list(paths)
        # bounded and checked before the library maps the file (files.read_safetensors_header)
        headers = [files.read_safetensors_header(p) for p in self._paths]
        if len(headers) == 1:  # one file: its tensors as they are (a 0-d one included)
            shapes = {n: e["shape"] for n, e in headers[0].items() if n != "__metadata__"}
            dtypes = {n: e["dtype"] for n, e in headers[0].items() if n != "__metadata__"}
        else:
            shapes, dtypes, problems = merged_shapes(headers, [p.name for p in self._paths])
            if problems:
                raise ValueError("; ".join(problems[:4]))
        self._names = [n for n in shapes if keep(n)]
        self._counts = {n: [int(h[n]["shape"][0]) if h[n]["shape"] else 1 for h in headers] for n in self._names}
        self.shapes: dict[str, tuple] = {n: tuple(int(d) for d in shapes[n]) for n in self._names}
        self.dtypes: dict[str, str] = {n: str(dtypes[n]) for n in self._names}
        self._opened: list | None = None

    @property
    def paths(self) -> list[Path]:
        return list(self._paths)

    @property
    def _handles(self) -> list:
        if self._opened is None:
            from safetensors import safe_open

            self._opened = [safe_open(str(p), framework="pt") for p in self._paths]
        return self._opened

    def __getitem__(self, name: str):
        import torch

        if name not in self._counts:
            raise KeyError(name)
        pieces = [h.get_tensor(name) for h in self._handles]
        if len(pieces) == 1 or pieces[0].dim() == 0:  # one file, or a scalar (every part holds it whole)
            return pieces[0]
        return torch.cat(pieces, dim=0)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def rows(self, name: str, start: int, stop: int):
        """Rows ``start:stop`` of the whole tensor ``name``."""
        import torch

        pieces, offset = [], 0
        for handle, count in zip(self._handles, self._counts[name], strict=True):
            a, b = max(start, offset), min(stop, offset + count)
            if a < b:
                pieces.append(handle.get_slice(name)[a - offset:b - offset])
            offset += count
        if not pieces:  # a rank past the last row
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[self.dtypes[name]]
            return torch.empty((0, *self.shapes[name][1:]), dtype=dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def write_part(path: Path, tensors: dict[str, Any], step: int, rank: int, world: int) -> tuple[str, int]:
    """This rank's part, atomically (temp file, fsync, rename). Returns (SHA-256, size)."""
    return files.write_safetensors(path, tensors, metadata={
        "format": "apr-checkpoint-part", "step": str(step), "part": str(rank), "parts": str(world)})
