"""Where prompts come from: ``--prompt`` (repeatable; ``-`` reads all of stdin as one prompt) and
``--prompt-file`` (one prompt per line; ``-`` reads stdin). Blank lines of a file are skipped."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from apr.errors import AprError, Finding
from apr.readers import read_text


def read_prompts(prompts: list[str], prompt_file: str | None, stdin=None) -> list[str]:
    stdin = stdin if stdin is not None else sys.stdin
    out: list[str] = []
    for p in prompts:
        out.append(stdin.read() if p == "-" else p)
    if prompt_file is not None:
        if prompt_file == "-":
            text = stdin.read()
        else:
            path = Path(prompt_file).expanduser()
            if not os.path.lexists(path):  # a symlink loop or a dangling link is named by read_text
                raise AprError(f"prompt file {path} not found", [Finding(
                    "error", "generate.prompt_file", "no such file", path="--prompt-file", file=str(path))])

            text = read_text(path, "task", "prompt file")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise AprError(f"the prompt file {prompt_file} holds no prompt", [Finding(
                "error", "generate.empty_prompt", "no non-blank line", path="--prompt-file", file=prompt_file,
                expected="one prompt per line", got="nothing")])
        out += lines
    if not out:
        raise AprError("no prompt given: pass --prompt TEXT or --prompt-file FILE", [Finding(
            "error", "generate.no_prompt", "no prompt", path="--prompt", expected="--prompt or --prompt-file",
            got="neither")])
    return out
