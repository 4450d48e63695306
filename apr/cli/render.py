"""Rendering of findings and errors for humans (text) and machines (JSON)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable

from apr.errors import AprError, Finding

FORMAT_VERSION = "1"


def _colour(stream) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


def use_colour(stream) -> bool:
    """Colour only on a terminal, and never with NO_COLOR set."""
    return _colour(stream)


def format_finding(f: Finding, colour: bool = False) -> str:
    where = f.file or ""
    if f.line is not None:
        where += f":{f.line}" + (f":{f.column}" if f.column is not None else "")
    sev = f.severity
    if colour:
        sev = {"error": "\x1b[31merror\x1b[0m", "warning": "\x1b[33mwarning\x1b[0m"}.get(sev, sev)
    head = f"{sev}[{f.code}]"
    parts = [head]
    if where:
        parts.append(where)
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


def print_error(err: AprError, stream=None) -> None:
    """The one place an AprError is shown to a person: ``error: message`` and its findings."""
    stream = stream or sys.stderr
    print(f"error: {err.message}", file=stream)
    print_findings(err.findings, stream)


def error_exit(err: AprError) -> int:
    """Print ``err`` and return its exit code (for commands that return an exit status)."""
    print_error(err)
    return err.exit_code


def findings_json(findings: Iterable[Finding], **extra) -> str:
    doc = {"format_version": FORMAT_VERSION, **extra, "findings": [f.to_dict() for f in findings]}
    return json.dumps(doc, indent=2, default=str)
