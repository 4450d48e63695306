"""Findings as GitHub Actions workflow commands and a Markdown step summary (`--format github`).

One annotation per finding: ``::error file=F,line=L,col=C,title=T::MESSAGE`` (``warning`` and
``notice`` likewise), escaped as the workflow-command grammar requires: ``%``, CR and LF in the
message; those and ``:`` and ``,`` in property values. Paths are made relative to
``$GITHUB_WORKSPACE`` (else the current folder) when under it, since GitHub matches annotations
against repository paths. The summary is appended to ``$GITHUB_STEP_SUMMARY`` when that is set,
else printed after the annotations. docs/ci.md is the user's page.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from apr.errors import Finding

COMMAND = {"error": "error", "warning": "warning", "info": "notice"}


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def repo_path(file: str | None) -> str | None:
    """``file`` relative to the workspace (or the current folder) when it lies under it."""
    if not file:
        return None
    root = Path(os.environ.get("GITHUB_WORKSPACE") or os.getcwd()).resolve()
    try:
        return Path(file).resolve().relative_to(root).as_posix()
    except (ValueError, OSError, RuntimeError):
        return file


def annotation(f: Finding, default_file: str | None = None) -> str:
    props: list[tuple[str, str]] = []
    file = repo_path(f.file or default_file)
    if file:
        props.append(("file", file))
        if f.line is not None:
            props.append(("line", str(f.line)))
            if f.column is not None:
                props.append(("col", str(f.column)))
    props.append(("title", f"{f.code} {f.path}".strip()))
    message = f"{f.path}: {f.message}" if f.path and not f.message.startswith(f.path) else f.message
    details = [f"expected {f.expected}"] if f.expected is not None else []
    details += [f"got {f.got}"] if f.got is not None else []
    if details and not all(d in message for d in details):
        message += f" ({', '.join(details)})"
    head = ",".join(f"{k}={escape_property(v)}" for k, v in props)
    return f"::{COMMAND.get(f.severity, 'notice')} {head}::{escape_data(message)}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_markdown(title: str, verdict: str, findings: list[Finding], default_file: str | None = None,
                     facts: Iterable[tuple[str, str]] = ()) -> str:
    """A step summary: a heading with the verdict, the key figures, and one table row per finding."""
    icon = {"valid": "✅", "ok": "✅", "invalid": "❌", "errors": "❌"}.get(verdict.split()[0], "⚠️")
    lines = [f"### {icon} {_cell(title)}: {verdict}", ""]
    facts = list(facts)
    if facts:
        lines += ["| | |", "|---|---|", *[f"| {_cell(k)} | {_cell(v)} |" for k, v in facts], ""]
    if findings:
        lines += ["| severity | code | where | message |", "|---|---|---|---|"]
        for f in findings:
            where = repo_path(f.file or default_file) or ""
            if f.line is not None:
                where += f":{f.line}"
            if f.path:
                where += f" `{f.path}`"
            lines.append(f"| {f.severity} | {f.code} | {_cell(where)} | {_cell(f.message)} |")
    else:
        lines.append("No findings.")
    return "\n".join(lines) + "\n"


def emit(findings: list[Finding], summary: str, default_file: str | None, out) -> None:
    """Print the annotations to ``out`` and append the summary to $GITHUB_STEP_SUMMARY (else print it).
    A summary file that cannot be written is reported as a warning annotation, never a failure."""
    for f in findings:
        print(annotation(f, default_file), file=out)
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if target:
        try:
            with open(target, "a", encoding="utf-8") as fh:
                fh.write(summary)
            return
        except OSError as err:
            print(f"::warning title=apr::{escape_data(f'cannot write the step summary to {target}: {err}')}",
                  file=out)
    print(summary, file=out, end="")
