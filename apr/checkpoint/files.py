"""The bytes of a checkpoint: a streaming safetensors writer that hashes while it writes, SHA-256 of
a file, the JSON encoding of non-finite floats, and the file names.

The writer streams one tensor at a time (a tensor on a GPU is copied to the host on its own), so
saving never holds a second copy of the whole model in host memory, and the SHA-256 comes for free
instead of a second read of a multi-gigabyte file. The layout is plain safetensors (8-byte
little-endian header length, JSON header padded with spaces to 8 bytes, tensors back to back), so the
official `safetensors` reader loads it; the tests check that.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from apr.fsutil import atomic_open, fsync_dir

STEP_PREFIX = "checkpoint-step-"
BEST_STEM = "checkpoint-best"
STEP_JSON_RE = re.compile(r"^checkpoint-step-(\d+)\.json$")
STEP_FILE_RE = re.compile(r"^checkpoint-step-(\d+)\.(json|safetensors)$")
TEMP_RE = re.compile(r"^\.checkpoint-.*\.tmp$")
PART_FILE_RE = re.compile(r"^checkpoint-step-(\d+)\.part-\d+-of-\d+\.safetensors$")  # one rank's weights

# torch dtype name -> safetensors dtype code
ST_DTYPE_CODES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
}
ST_DTYPE_NAMES = {code: name for name, code in ST_DTYPE_CODES.items()} | {"BOOL": "bool"}  # code -> name
_CHUNK = 8 << 20


def step_stem(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def safetensors_header(entries: list[tuple[str, str, tuple[int, ...], int]],
                       metadata: Mapping[str, str] | None = None) -> bytes:
    """The JSON header ``write_safetensors`` writes (padded to 8 bytes) for ``(name, dtype code,
    shape, bytes)`` entries in name order. Torch-free: the plan sizes a checkpoint with it."""
    header: dict[str, Any] = {}
    offset = 0
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return head + b" " * (-len(head) % 8)


def safetensors_size(entries: list[tuple[str, str, tuple[int, ...], int]],
                     metadata: Mapping[str, str] | None = None) -> int:
    """The exact size of the file ``write_safetensors`` writes for these entries: the 8-byte header
    length, the header, the tensor bytes."""
    return 8 + len(safetensors_header(entries, metadata)) + sum(e[3] for e in entries)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, Any],
                      metadata: Mapping[str, str] | None = None) -> tuple[str, int]:
    """Write ``tensors`` (torch tensors on any device) to ``path`` as safetensors, atomically: a temp
    file in the same folder, fsync, rename, fsync the folder. Returns (SHA-256 hex, size in bytes)."""
    import torch

    if sys.byteorder != "little":  # safetensors is little-endian; we write host bytes as they are
        raise RuntimeError("writing checkpoints needs a little-endian host")
    path = Path(path)
    names = sorted(tensors)
    entries = []
    for name in names:
        t = tensors[name]
        code = ST_DTYPE_CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in a checkpoint")
        entries.append((name, code, tuple(t.shape), t.numel() * t.element_size()))
    head = safetensors_header(entries, metadata)
    prefix = struct.pack("<Q", len(head))

    digest = hashlib.sha256()
    size = 0
    with atomic_open(path) as f:
        for part in (prefix, head):
            f.write(part)
            digest.update(part)
            size += len(part)
        for name in names:
            t = tensors[name].detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            if t.numel() == 0:
                continue
            buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            f.write(buf)
            digest.update(buf)
            size += buf.nbytes
    return digest.hexdigest(), size


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """(SHA-256 hex, size) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


# Bounds on a safetensors header, checked before it is parsed or anything is allocated from it: a
# hostile file (one shared as a checkpoint, or a Hugging Face model to import) must not make a command
# hang or take unbounded memory. Real headers are far inside them (a 70B model shard: ~1,000
# tensors, a 40 KiB header). Every tensor's bytes must lie inside the file, so nothing read from a
# header asks for more memory than the file holds.
MAX_HEADER_BYTES = 100 << 20
MAX_HEADER_TENSORS = 100_000
MAX_TENSOR_RANK = 8
MAX_NAME_CHARS = 1024
ST_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                 "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets, ``__metadata__``),
    checked: a length inside the file and ``MAX_HEADER_BYTES``, at most ``MAX_HEADER_TENSORS``
    entries (counted before parsing), and for every tensor a known dtype, a shape of at most
    ``MAX_TENSOR_RANK`` non-negative ints whose bytes are exactly its offsets' span, inside the file.
    A ValueError says what is wrong (a short message: nothing of the header is echoed at length)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO is refused below, never waited on
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        size = st.st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"header length {n} is not plausible (at most {MAX_HEADER_BYTES})")
        if n > size - 8:
            raise ValueError(f"header cut short: it claims {n} bytes, the file holds {size - 8} after its length")
        head = f.read(n)
        if len(head) != n:
            raise ValueError("header cut short")
    if head.count(b"{") > MAX_HEADER_TENSORS + 2 or head.count(b"[") > 2 * MAX_HEADER_TENSORS + 2:
        raise ValueError(f"header describes more than {MAX_HEADER_TENSORS} tensors")
    try:
        doc = json.loads(head.decode("utf-8"))
    except RecursionError:
        raise ValueError("header nests too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError("header is not a JSON object")
    _check_entries(doc, size - 8 - n)
    return doc


def _check_entries(doc: dict, data_bytes: int) -> None:
    """Every tensor entry well formed, its bytes inside the ``data_bytes`` after the header."""
    meta = doc.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("header's __metadata__ is not a mapping of strings")
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        shown = name if len(name) <= 80 else name[:77] + "..."
        if len(name) > MAX_NAME_CHARS:
            raise ValueError(f"tensor name {shown!r} is longer than {MAX_NAME_CHARS} characters")
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {shown!r}: its entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ST_ITEM_BYTES:
            raise ValueError(f"tensor {shown!r}: unknown dtype {str(dtype)[:20]!r}")
        if not (isinstance(shape, list) and len(shape) <= MAX_TENSOR_RANK
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {shown!r}: shape is not a list of at most {MAX_TENSOR_RANK} non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ValueError(f"tensor {shown!r}: data_offsets are not a [start, end] inside the file")
        nbytes = ST_ITEM_BYTES[dtype]
        for d in shape:  # stops as soon as the product passes the file: no huge number is formed
            nbytes *= d
            if nbytes > data_bytes:
                break
        if nbytes != offsets[1] - offsets[0]:
            need = "more than the file holds" if nbytes > data_bytes else f"{nbytes} bytes"
            raise ValueError(f"tensor {shown!r}: its shape and dtype need {need}, its offsets span "
                             f"{offsets[1] - offsets[0]}")


def interrupted_save(path: str | os.PathLike) -> bool:
    """Whether ``path``, a step's weights file (``checkpoint-step-N.safetensors`` or one rank's part)
    whose JSON is absent, is apr's own interrupted save: a regular file whose safetensors header
    names apr's checkpoint format and step N. The weights are renamed into place before the JSON is
    written, so a kill between the two leaves exactly this. Such a file is not a checkpoint (nothing
    says which run or trainer state it belongs to); a file that is not apr's is the user's."""
    path = Path(path)
    m = STEP_FILE_RE.match(path.name)
    if m and m.group(2) == "safetensors":
        step = m.group(1)
    else:
        m = PART_FILE_RE.match(path.name)
        if not m:
            return False
        step = m.group(1)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        meta = read_safetensors_header(path).get("__metadata__")
    except (OSError, ValueError):  # unreadable, not safetensors, not UTF-8: not apr's
        return False
    return (isinstance(meta, dict) and meta.get("format") in ("apr-checkpoint", "apr-checkpoint-part")
            and meta.get("step") == step)


def interrupted_saves(run_dir: str | os.PathLike) -> list[str]:
    """Names of the interrupted saves (:func:`interrupted_save`) in ``run_dir``: step weights files
    whose JSON is absent. Sorted."""
    run_dir = Path(run_dir)
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return []
    out = []
    for name in names:
        m = STEP_FILE_RE.match(name) or PART_FILE_RE.match(name)
        if not m or name.endswith(".json"):
            continue
        if not os.path.lexists(run_dir / f"{step_stem(int(m.group(1)))}.json") and interrupted_save(run_dir / name):
            out.append(name)
    return out


def interrupted_message(names: list[str]) -> str:
    """What a fresh run says about the interrupted saves it found (and will replace)."""
    shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    return (f"{shown}: weights of an interrupted save (the run stopped before writing the JSON), not a "
            "checkpoint; nothing of that run can be resumed, and this run replaces "
            + ("it" if len(names) == 1 else "them"))


def link_or_copy(src: Path, dst: Path) -> None:
    """Make ``dst`` hold the bytes of ``src`` atomically: a hard link (free) where the file system
    allows it, else a fsynced copy; either is renamed over ``dst``."""

    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dst)
    fsync_dir(dst.parent)


def unlink_quiet(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------ JSON with non-finite floats

_FLOAT_TAG = "__float__"


def encode_floats(obj: Any) -> Any:
    """Replace inf/-inf/nan (not valid JSON) by ``{"__float__": "inf"}`` etc., so they survive a
    round trip exactly (a trainer's ``best_val_loss`` starts at inf)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT_TAG: "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_floats(v) for v in obj]
    return obj


def decode_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _FLOAT_TAG in obj and obj[_FLOAT_TAG] in ("inf", "-inf", "nan"):
            return float(obj[_FLOAT_TAG])
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj
