"""Bounded reading: the one way apr reads a file a user (or a crash, or an attacker) can hand it.

Every reader of configs, plan files, state files, tokenizers, checkpoint sidecars and caches goes
through here, so a hostile input fails fast with the usual error format instead of hanging or
exhausting memory (docs/design.md, "Bounded reading"):

* only regular files are opened: a FIFO, device (``/dev/zero``), socket or directory is refused
  from ``stat`` before any read, and the file is opened non-blocking and checked again with
  ``fstat``, so swapping in a FIFO between the two cannot hang us;
* a symlink loop is reported as such, a dangling symlink names its target;
* each kind of file has a size cap (``LIMITS``), checked before reading and again while reading
  (a file that grows, or a ``/proc`` file that claims size 0, cannot get past it);
* JSON nesting is bounded (``MAX_JSON_DEPTH``): too deep is a clean error naming the key path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from typing import Any

from apr.errors import AprError, Finding

KiB, MiB = 2**10, 2**20

# Size caps per kind of file. Real files are far below them (a config is a few KiB, a state file
# well under 1 MiB); the caps only keep a wrong or hostile file from costing minutes or gigabytes.
LIMITS: dict[str, int] = {
    "config": 64 * KiB,  # YAML; ruamel parses ~100 KiB/s, so this keeps any config under a second
    "settings": 64 * KiB,  # monitor settings (YAML)
    "plan": 16 * MiB,  # plan files: the resolved config plus one fingerprint row per data file
    "state": 16 * MiB,  # training_state.json (the writer bounds its histories)
    "checkpoint": 1 * MiB,  # checkpoint JSON sidecars
    "manifest": 16 * MiB,  # data manifests, cache metadata
    "tokenizer": 64 * MiB,  # tokenizer.json (vocab and merges of large vocabularies)
    "task": 512 * MiB,  # multiple-choice task JSONL and prompt files (apr eval, apr generate)
    "steer": 64 * KiB,  # apr train steer requests and their applied records
}
MAX_JSON_DEPTH = 64  # nesting levels of any JSON document apr reads (ours use fewer than 8)

_KIND_WORDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


class InputError(AprError):
    """A file apr was asked to read is missing, not a regular file, too large or malformed."""


def _fail(error: type[AprError], file: str, code: str, message: str, **kw: Any) -> AprError:
    return error(message, [Finding("error", code, message, file=file, **kw)])


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.1f} {unit}"
    return f"{n} bytes"


def file_kind(mode: int) -> str:
    """A file type in words, for messages: 'a FIFO (named pipe)', 'a directory', ..."""
    return _KIND_WORDS.get(stat.S_IFMT(mode), "not a regular file")


def check_regular(path: str | os.PathLike, what: str = "file", *, error: type[AprError] = InputError,
                  expected: str | None = None) -> os.stat_result:
    """``stat`` of ``path`` when it is a regular file (symlinks followed); otherwise raise ``error``
    saying what is there instead: nothing, a dangling symlink, a symlink loop, a FIFO, a device..."""
    file = str(path)
    expected = expected or f"a {what}"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            target = os.readlink(path)
            raise _fail(error, file, "file.dangling_symlink",
                        f"{what} {file} is a symlink to {target}, which does not exist",
                        expected=expected, got=f"a dangling symlink to {target}") from None
        raise _fail(error, file, "file.missing", f"{what} not found: {file}", expected=expected,
                    got="nothing at this path") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _fail(error, file, "file.symlink_loop",
                        f"{what} {file} is a symlink loop (it resolves to itself)", expected=expected,
                        got="a symlink loop") from None
        if e.errno == errno.ENOTDIR:
            raise _fail(error, file, "file.missing",
                        f"{what} not found: {file} (a folder on its path is a file)", expected=expected,
                        got="nothing at this path") from None
        if e.errno == errno.ENAMETOOLONG:
            raise _fail(error, file[:200], "file.missing", f"{what} path is too long ({len(file)} characters)",
                        expected=expected, got="a path the system refuses") from None
        raise _fail(error, file, "file.unreadable", f"cannot read {what} {file}: {e.strerror or e}",
                    expected=expected) from None
    if not stat.S_ISREG(st.st_mode):
        kind = file_kind(st.st_mode)
        code = "file.directory" if stat.S_ISDIR(st.st_mode) else "file.not_regular"
        raise _fail(error, file, code, f"{what} {file} is {kind}, not a regular file",
                    expected=expected, got=kind)
    return st


def read_bytes(path: str | os.PathLike, kind: str, what: str = "file", *,
               error: type[AprError] = InputError, limit: int | None = None) -> bytes:
    """The whole content of a regular file of at most ``LIMITS[kind]`` bytes; raises ``error``
    (an AprError with one finding naming the file) for anything else. Never blocks on a FIFO."""
    file = str(path)
    cap = LIMITS[kind] if limit is None else limit
    st = check_regular(path, what, error=error)

    def too_large(size_word: str) -> AprError:
        return _fail(error, file, "file.too_large",
                     f"{what} {file} is {size_word}: more than the {human_bytes(cap)} a {kind} file may be",
                     expected=f"at most {human_bytes(cap)}", got=size_word)

    if st.st_size > cap:
        raise too_large(human_bytes(st.st_size))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise _fail(error, file, "file.unreadable", f"cannot read {what} {file}: {e.strerror or e}",
                    expected=f"a readable {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between stat and open
            kindword = file_kind(st.st_mode)
            raise _fail(error, file, "file.not_regular", f"{what} {file} is {kindword}, not a regular file",
                        expected=f"a {what}", got=kindword)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(cap + 1 - total, 4 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise too_large(f"over {human_bytes(cap)}")
        return b"".join(chunks)
    except OSError as e:
        raise _fail(error, file, "file.unreadable", f"cannot read {what} {file}: {e.strerror or e}",
                    expected=f"a readable {what}") from None
    finally:
        os.close(fd)


def decode_utf8(data: bytes, file: str, what: str = "file", *, error: type[AprError] = InputError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise _fail(error, file, "file.encoding", f"{what} {file} is not UTF-8 text (invalid byte at line {line})",
                    line=line, expected="UTF-8 text", got=f"byte 0x{data[e.start]:02x} at offset {e.start}") from None


def read_text(path: str | os.PathLike, kind: str, what: str = "file", *,
              error: type[AprError] = InputError) -> str:
    """``read_bytes`` decoded as UTF-8 (a clean error naming the line of the first bad byte)."""
    return decode_utf8(read_bytes(path, kind, what, error=error), str(path), what, error=error)


def _key_path(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def too_deep_at(doc: Any, max_depth: int = MAX_JSON_DEPTH) -> list | None:
    """The key path at which ``doc`` (parsed JSON/YAML) nests deeper than ``max_depth``, else None.
    Iterative, so it cannot itself run out of stack."""
    stack: list[tuple[Any, list]] = [(doc, [])]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        if len(where) >= max_depth:
            return where
        for key, value in items:
            if isinstance(value, (dict, list)):
                stack.append((value, where + [key]))
    return None


def loads_json(text: str, file: str, what: str = "file", *, error: type[AprError] = InputError,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text; invalid JSON and nesting deeper than ``max_depth`` are clean errors."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(error, file, "file.json", f"{what} {file} is invalid JSON: {e.msg} at line {e.lineno}, "
                                               f"column {e.colno}", line=e.lineno, column=e.colno,
                    expected="valid JSON") from None
    except RecursionError:
        raise _fail(error, file, "file.too_deep", f"{what} {file} nests more than {max_depth} levels deep",
                    expected=f"at most {max_depth} levels of nesting", got="far deeper nesting") from None
    where = too_deep_at(doc, max_depth)
    if where is not None:
        raise _fail(error, file, "file.too_deep", f"{what} {file} nests more than {max_depth} levels deep",
                    path=_key_path(where), expected=f"at most {max_depth} levels of nesting",
                    got=f"deeper nesting under {_key_path(where) or 'the top level'}")
    return doc


def load_json(path: str | os.PathLike, kind: str, what: str = "file", *,
              error: type[AprError] = InputError) -> Any:
    """Read (bounded) and parse a JSON file. Raises ``error`` with one finding naming the file."""
    return loads_json(read_text(path, kind, what, error=error), str(path), what, error=error)


def is_regular(path: str | os.PathLike) -> bool:
    """True for a regular file (symlinks followed); False for anything else, never raises."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


# What ``content_digest`` reads of a file: all of a small one; of a large one its head, its tail (a
# Parquet footer: row groups, offsets, statistics) and evenly spread samples of the rest.
DIGEST_WHOLE = 1 * MiB
DIGEST_HEAD, DIGEST_TAIL, DIGEST_SAMPLES, DIGEST_SAMPLE = 64 * KiB, 1 * MiB, 64, 4 * KiB


def content_digest(path: str | os.PathLike) -> str:
    """A cheap content digest (BLAKE2b, 16 bytes, hex) of a regular file: its size plus all of its
    bytes when it is at most ``DIGEST_WHOLE``, else its head, its tail and ``DIGEST_SAMPLES`` evenly
    spread blocks (about 1.3 MiB read however large the file). A change inside a large file that
    falls between the samples is not seen. Raises OSError like ``open``."""

    digest = hashlib.blake2b(digest_size=16)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{file_kind(st.st_mode)}, not a regular file", str(path))
        size = st.st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= DIGEST_WHOLE:
            spans = [(0, size)]
        else:
            stride = (size - DIGEST_HEAD - DIGEST_TAIL) // (DIGEST_SAMPLES + 1)
            spans = ([(0, DIGEST_HEAD)] + [(DIGEST_HEAD + stride * (k + 1), DIGEST_SAMPLE)
                                           for k in range(DIGEST_SAMPLES)] + [(size - DIGEST_TAIL, DIGEST_TAIL)])
        for offset, length in spans:
            digest.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)
    return digest.hexdigest()


__all__ = ["LIMITS", "MAX_JSON_DEPTH", "InputError", "check_regular", "read_bytes", "read_text", "decode_utf8",
           "loads_json", "load_json", "too_deep_at", "is_regular", "human_bytes", "file_kind",
           "content_digest"]
