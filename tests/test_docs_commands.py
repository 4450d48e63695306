"""Every `apr ...` command line the user docs show names a real command and only options it has
(a renamed flag or command fails here, not in a user's terminal)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import typer

from apr.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`(apr [^`]+)`")


def command_lines(text: str) -> list[str]:
    """`apr ...` lines of code blocks (a `$ ` prompt stripped, `\\` continuations joined) and inline code."""
    found = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("apr ") or line.startswith("torchrun ") and " apr " in line:
                found.append(line[line.index("apr "):] if line.startswith("torchrun") else line)
    return found + INLINE.findall(text)


def _is_group(command) -> bool:
    return hasattr(command, "list_commands")  # typer vendors click: isinstance(click.Group) does not hold


def problems_of(line: str, root: click.Command) -> list[str]:
    try:
        words = shlex.split(line.split(" #")[0].split(" | ")[0].split(" > ")[0].split(" && ")[0])
    except ValueError:
        return []  # a fragment, not a command line
    command, ctx = root, click.Context(root, info_name="apr")
    for i, word in enumerate(words[1:], 1):
        if not _is_group(command) or word.startswith("-"):
            break
        sub = command.get_command(ctx, word)
        if sub is None:
            if re.fullmatch(r"[a-z][a-z-]*", word):
                return [f"{line!r}: {' '.join(words[:i])} has no command {word!r}"]
            break  # a placeholder such as CONFIG or ...
        command, ctx = sub, click.Context(sub, parent=ctx, info_name=word)
    if _is_group(command):
        return []  # `apr train` alone, a group named in prose
    options = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
    return [f"{line!r}: {ctx.command_path} has no option {word.split('=')[0]!r}"
            for word in words if word.startswith("--") and word.split("=")[0] not in options]


def test_every_documented_command_and_option_exists():
    root = typer.main.get_command(app)
    lines = [(path, line) for path in DOCS for line in command_lines(path.read_text())]
    assert len(lines) > 50  # the docs do show commands
    bad = [f"{path.relative_to(ROOT)}: {p}" for path, line in lines for p in problems_of(line, root)]
    assert bad == []


def test_a_wrong_command_or_flag_is_caught():
    root = typer.main.get_command(app)
    assert problems_of("apr train plan cfg.yaml --gpu 4090", root) == []
    assert problems_of("apr train plna cfg.yaml", root) == [
        "'apr train plna cfg.yaml': apr train has no command 'plna'"]
    assert problems_of("apr train plan cfg.yaml --gpus 4090", root) == [
        "'apr train plan cfg.yaml --gpus 4090': apr train plan has no option '--gpus'"]
    assert command_lines("```\n$ apr train apply cfg.yaml \\\n    --max-steps 3\n```\nrun `apr runs ls`") == [
        "apr train apply cfg.yaml --max-steps 3", "apr runs ls"]
