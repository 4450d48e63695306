"""Multiple-choice tasks from local JSONL files, one example per line:

    {"context": "The capital of France is", "choices": [" Paris", " Rome", " Oslo"], "gold": 0}

``context`` is a non-empty string, ``choices`` a list of at least two non-empty strings, ``gold``
the index of the right choice; an optional ``id`` is kept. Any other key is ignored. A malformed
line is reported with its file and line number; ``on_error="skip"`` skips it with a warning
instead of stopping.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from apr.errors import AprError, Finding
from apr.quoting import describe, key_text
from apr.readers import read_bytes

ON_ERROR = ("stop", "skip")


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int
    id: str | None = None


@dataclass
class Task:
    name: str
    examples: list[Example]
    source: str  # the file, or "builtin"
    skipped: list[Finding] = field(default_factory=list)  # malformed lines skipped


def _problem(path: Path, line: int, key: str, message: str, expected: str, got: str) -> Finding:
    return Finding("error", "eval.task_line", message, path=key, file=str(path), line=line, expected=expected,
                   got=got)


def _short(value) -> str:
    return describe(value)  # the one rule of what an error may quote (apr/quoting.py)


def parse_example(doc, path: Path, line: int) -> Example:
    """One example from a decoded JSON line; AprError naming the file, line and key otherwise."""
    if not isinstance(doc, dict):
        raise AprError(f"{path}:{line}: not a JSON object", [_problem(
            path, line, "", "not a JSON object", "an object with context, choices, gold", type(doc).__name__)])
    for key in ("context", "choices", "gold"):
        if key not in doc:
            raise AprError(f"{path}:{line}: missing key {key!r}", [_problem(
                path, line, key, f"missing key {key!r}", "context, choices and gold",
                ", ".join(key_text(k) for k in list(doc)[:8]) or "{}")])
    context, choices, gold = doc["context"], doc["choices"], doc["gold"]
    if not isinstance(context, str) or not context:
        raise AprError(f"{path}:{line}: context must be a non-empty string", [_problem(
            path, line, "context", "context must be a non-empty string", "non-empty text", _short(context))])
    if (not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)):
        raise AprError(f"{path}:{line}: choices must be a list of at least two non-empty strings", [_problem(
            path, line, "choices", "choices must be a list of at least two non-empty strings",
            "[\"...\", \"...\", ...]", _short(choices))])
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise AprError(f"{path}:{line}: gold must be an index into choices", [_problem(
            path, line, "gold", "gold must be an index into choices", f"an integer 0..{len(choices) - 1}",
            _short(gold))])
    ident = doc.get("id")
    return Example(context=context, choices=tuple(choices), gold=gold, id=None if ident is None else str(ident))


def read_task(path: str | Path, on_error: str = "stop", limit: int | None = None) -> Task:
    """The examples of a JSONL task file (the first ``limit``). ``on_error`` is ``stop`` (raise on the
    first malformed line) or ``skip`` (record it in ``Task.skipped`` and go on)."""
    path = Path(path).expanduser()
    if on_error not in ON_ERROR:
        raise AprError(f"--on-error must be stop or skip, not {on_error!r}", [Finding(
            "error", "eval.option", "unknown --on-error", path="--on-error", expected="stop or skip", got=on_error)])
    if not os.path.lexists(path):  # a symlink loop or a dangling link is named by read_bytes
        raise AprError(f"task file {path} not found", [Finding(
            "error", "eval.task_missing", "no such file", path="--task", file=str(path),
            expected="a JSONL file or a built-in task (stdlib-nextline)")])

    raw = read_bytes(path, "task", "task file")  # a regular file of bounded size, or a clean error
    examples: list[Example] = []
    skipped: list[Finding] = []
    for number, line_bytes in enumerate(raw.splitlines(), start=1):
        if limit is not None and len(examples) >= limit:
            break
        if not line_bytes.strip():
            continue
        try:
            try:
                doc = json.loads(line_bytes.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise AprError(f"{path}:{number}: not UTF-8", [_problem(
                    path, number, "", f"not UTF-8 ({err.reason} at byte {err.start})", "UTF-8 JSON",
                    "bytes")]) from None
            except json.JSONDecodeError as err:
                raise AprError(f"{path}:{number}: not valid JSON: {err.msg}", [Finding(
                    "error", "eval.task_line", f"not valid JSON: {err.msg}", file=str(path), line=number,
                    column=err.colno, expected="one JSON object per line",
                    got=f"a line of {len(line_bytes):,} bytes (not shown)")]) from None
            except ValueError:  # an integer of more than 4,300 digits (Python's int-from-text limit)
                raise AprError(f"{path}:{number}: a number too long", [Finding(
                    "error", "eval.task_line", "a number longer than 4,300 digits", file=str(path), line=number,
                    expected="one JSON object per line, numbers of at most 4,300 digits",
                    got="a longer number")]) from None
            except RecursionError:  # '[[[[...' nested deeper than the parser's stack
                raise AprError(f"{path}:{number}: nested too deep", [Finding(
                    "error", "eval.task_line", "JSON nested too deep", file=str(path), line=number,
                    expected="one flat JSON object per line", got="deeply nested arrays or objects")]) from None
            examples.append(parse_example(doc, path, number))
        except AprError as err:
            if on_error == "stop":
                raise AprError(err.message + " (pass --on-error skip to skip malformed lines)", err.findings) from None
            skipped += [Finding("warning", f.code, f.message, f.path, f.file, f.line, f.column, f.expected, f.got)
                        for f in err.findings]
    if not examples:
        raise AprError(f"{path} holds no example", [Finding(
            "error", "eval.task_empty", "no valid example", path="--task", file=str(path),
            expected="at least one JSON line with context, choices, gold",
            got=f"{len(skipped)} malformed lines" if skipped else "nothing")])
    return Task(name=path.stem, examples=examples, source=str(path), skipped=skipped)
