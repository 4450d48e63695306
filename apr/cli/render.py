"""Rendering of findings and errors for humans (text) and machines (JSON)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import replace

from apr.errors import AprError, Finding

FORMAT_VERSION = "1"


def _colour(stream) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


def use_colour(stream) -> bool:
    """Colour only on a terminal, and never with NO_COLOR set."""
    return _colour(stream)


def format_finding(f: Finding, colour: bool = False, where_colon: bool = False) -> str:
    """``severity[code] file:line:col key: message (expected ..., got ...)``; ``where_colon``: a
    colon after the location when no key follows it (an error's one line)."""
    where = f.file or ""
    if f.line is not None:
        where += f":{f.line}" + (f":{f.column}" if f.column is not None else "")
    sev = f.severity
    if colour:
        sev = {"error": "\x1b[31merror\x1b[0m", "warning": "\x1b[33mwarning\x1b[0m"}.get(sev, sev)
    head = f"{sev}[{f.code}]"
    parts = [head]
    if where:
        parts.append(where + (":" if where_colon and not f.path else ""))
    if f.path:
        parts.append(f.path + ":")
    text = " ".join(parts) + " " + f.message
    details = []
    if f.expected is not None:
        details.append(f"expected {f.expected}")
    if f.got is not None:
        details.append(f"got {f.got}")
    if details and not all(d in f.message for d in details):
        text += f" ({', '.join(details)})"
    return text


def print_findings(findings: Iterable[Finding], stream=None) -> None:
    stream = stream or sys.stderr
    colour = _colour(stream)
    for f in findings:
        print(format_finding(f, colour), file=stream)


_COUNT_HEADER = re.compile(r"(?:^|: )\d[\d,]* [\w ]*(?:errors?|problems?)$")


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def _where(f: Finding) -> str:
    where = f.file or ""
    if f.line is not None:
        where += f":{f.line}" + (f":{f.column}" if f.column is not None else "")
    return where


def merged_message(err: AprError, f: Finding) -> str:
    """The one sentence an error with one finding is shown with: the error's message and the
    finding's, once (the longer when one says all the other does), the location the coded line
    already shows taken off the front."""
    text = err.message
    first = text.split(": ", 1)[0]
    if ": " in text and first and _where(f).startswith(first):  # the file (or its folder) the line names
        text = text[len(first) + 2:]
    at = text.find(f"{f.path}: ") if f.path else -1
    if 0 <= at <= 40:  # "setting training.max_steps: ...": the key is on the line already
        text = text[at + len(f.path) + 2:]
    if not text or _COUNT_HEADER.search(text):  # "config.yaml: 1 schema error": the finding says which
        return f.message
    if _words(f.message) <= _words(text):
        return text
    if _words(text) <= _words(f.message):
        return f.message
    return f"{text}; {f.message}"


def print_error(err: AprError, stream=None) -> None:
    """The one place an AprError is shown to a person, once: with one finding, one coded line
    carrying the error's message (``error[code] file:line key: message (expected ..., got ...)``);
    with several, ``error: message`` and a coded line per finding; with none, ``error: message``."""
    stream = stream or sys.stderr
    findings = list(err.findings)
    if len(findings) == 1:
        f = findings[0]
        print(format_finding(replace(f, message=merged_message(err, f)), _colour(stream), where_colon=True),
              file=stream)
        return
    print(f"error: {err.message}", file=stream)
    print_findings(findings, stream)


def error_exit(err: AprError) -> int:
    """Print ``err`` and return its exit code (for commands that return an exit status)."""
    print_error(err)
    return err.exit_code


def findings_json(findings: Iterable[Finding], **extra) -> str:
    doc = {"format_version": FORMAT_VERSION, **extra, "findings": [f.to_dict() for f in findings]}
    return json.dumps(doc, indent=2, default=str)
