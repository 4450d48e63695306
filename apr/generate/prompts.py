"""Where prompts come from: ``--prompt`` (repeatable; ``-`` reads all of stdin as one prompt) and
``--prompt-file`` (one prompt per line; ``-`` reads stdin). Blank lines of a file are skipped.

All prompts are generated as one batch, so what is read is bounded: stdin and a prompt file at most
``MAX_PROMPT_BYTES``, at most ``MAX_PROMPTS`` prompts (docs/generate.md). Stdin is read in chunks and
refused as soon as it passes the cap, so ``yes | apr generate --prompt-file -`` ends at once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from apr.errors import AprError, Finding
from apr.readers import human_bytes, read_bytes

MAX_PROMPT_BYTES = 16 * 2**20  # stdin or a prompt file; a batch this large is already hours of decoding
MAX_PROMPTS = 4096  # prompts of one batch (each holds a KV cache for the whole generation)
# One prompt: far more than any context apr trains (tokens are rarely under one byte each), and
# refused by size before the tokenizer sees it (tokenizing 15 MiB takes gigabytes and seconds).
MAX_PROMPT_ONE = 1 * 2**20
_CHUNK = 1 << 16


def _too_large(option: str, where: str) -> AprError:
    message = f"{option} {where} holds more than {human_bytes(MAX_PROMPT_BYTES)}; split it into smaller batches"
    return AprError(message, [Finding("error", "generate.prompt_too_large", message, path=option, file=where,
                                      expected=f"at most {human_bytes(MAX_PROMPT_BYTES)}",
                                      got=f"more than {human_bytes(MAX_PROMPT_BYTES)}")])


def _read_stdin(stdin, option: str) -> str:
    """All of stdin, at most ``MAX_PROMPT_BYTES`` (read in chunks; more is refused, not buffered)."""
    source = getattr(stdin, "buffer", None)
    chunks: list = []
    size = 0
    while True:
        chunk = (source.read(_CHUNK) if source is not None else stdin.read(_CHUNK))
        if not chunk:
            break
        size += len(chunk)
        if size > MAX_PROMPT_BYTES:
            raise _too_large(option, "- (stdin)")
        chunks.append(chunk)
    if source is None:
        return "".join(chunks)
    return _decode(b"".join(chunks), option, "- (stdin)")


def _decode(data: bytes, option: str, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        message = (f"{option} {where} is not UTF-8 text: invalid byte 0x{data[e.start]:02x} at byte offset "
                   f"{e.start} (line {line})")
        raise AprError(message, [Finding("error", "generate.prompt_encoding", message, path=option, file=where,
                                         line=line, expected="UTF-8 text",
                                         got=f"byte 0x{data[e.start]:02x} at offset {e.start}")]) from None


def _check_one(text: str, where: str, option: str, file: str | None = None, line: int | None = None) -> None:
    """Refuse one prompt longer than ``MAX_PROMPT_ONE`` bytes, or one that is not UTF-8 (an
    argument with undecodable bytes), naming where it came from, never echoing it."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
        bad = text[e.start]
        byte = f"0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        message = f"{where} is not UTF-8 text: invalid byte {byte} at character {e.start}"
        raise AprError(message, [Finding("error", "generate.prompt_encoding", message, path=option, file=file,
                                         line=line, expected="UTF-8 text", got=f"byte {byte}")]) from None
    if size > MAX_PROMPT_ONE:
        message = (f"{where} is {human_bytes(size)}: one prompt may be at most {human_bytes(MAX_PROMPT_ONE)} "
                   "(far more than any model's context); shorten it")
        raise AprError(message, [Finding("error", "generate.prompt_too_large", message, path=option, file=file,
                                         line=line, expected=f"at most {human_bytes(MAX_PROMPT_ONE)} per prompt",
                                         got=human_bytes(size))])


def read_prompts(prompts: list[str], prompt_file: str | None, stdin=None,
                 origins: list[str] | None = None) -> list[str]:
    """The prompts, in order; ``origins`` (when given) receives where each came from (``--prompt``,
    ``--prompt-file FILE line N``), for errors that must not quote the prompt itself."""
    stdin = stdin if stdin is not None else sys.stdin
    out: list[str] = []
    where: list[str] = []
    stdin_read = False
    for p in prompts:
        if p == "-":
            if stdin_read:
                raise _stdin_twice("--prompt")
            stdin_read = True
            p = _read_stdin(stdin, "--prompt")
            name = "--prompt - (stdin)"
        else:
            name = "--prompt" if len(prompts) == 1 else f"--prompt {len(out) + 1}"
        _check_one(p, name, "--prompt")
        out.append(p)
        where.append(name)
    if prompt_file is not None:
        if prompt_file == "-":
            if stdin_read:
                raise _stdin_twice("--prompt-file")
            text = _read_stdin(stdin, "--prompt-file")
        else:
            path = Path(prompt_file).expanduser()
            if not os.path.lexists(path):  # a symlink loop or a dangling link is named by read_bytes
                raise AprError(f"prompt file {path} not found", [Finding(
                    "error", "generate.prompt_file", "no such file", path="--prompt-file", file=str(path))])
            # regular files only (never a FIFO or a device), refused unread past the cap
            data = read_bytes(path, "task", "prompt file", limit=MAX_PROMPT_BYTES, error=AprError)
            text = _decode(data, "--prompt-file", str(path))
        shown = "- (stdin)" if prompt_file == "-" else str(Path(prompt_file).expanduser())
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                name = f"--prompt-file {shown} line {n}"
                _check_one(line, name, "--prompt-file", file=shown, line=n)
                lines.append(line)
                where.append(name)
        if not lines:
            raise AprError(f"the prompt file {prompt_file} holds no prompt", [Finding(
                "error", "generate.empty_prompt", "no non-blank line", path="--prompt-file", file=prompt_file,
                expected="one prompt per line", got="nothing")])
        out += lines
    if not out:
        raise AprError("no prompt given: pass --prompt TEXT or --prompt-file FILE", [Finding(
            "error", "generate.no_prompt", "no prompt", path="--prompt", expected="--prompt or --prompt-file",
            got="neither")])
    if len(out) > MAX_PROMPTS:
        message = f"{len(out)} prompts: one batch takes at most {MAX_PROMPTS}; split the prompt file"
        raise AprError(message, [Finding("error", "generate.too_many_prompts", message,
                                         path="--prompt-file" if prompt_file is not None else "--prompt",
                                         file=prompt_file, expected=f"at most {MAX_PROMPTS} prompts",
                                         got=str(len(out)))])
    if origins is not None:
        origins[:] = where
    return out


def _stdin_twice(option: str) -> AprError:
    message = f"{option} -: stdin is already read by an earlier '-'; give '-' once"
    return AprError(message, [Finding("error", "generate.prompt_stdin", message, path=option,
                                      expected="one '-' in all", got="'-' twice")])
