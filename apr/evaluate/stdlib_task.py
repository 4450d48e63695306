"""``stdlib-nextline``: a multiple-choice task made from the running Python's standard library.

Each example shows up to ``CONTEXT_LINES`` consecutive lines of a module and asks which of four
lines comes next: the real one, or one of three lines drawn from other modules. It needs no
download, is the same for the same Python and seed, and a model trained on code scores well above
the 25% of a guess.
"""

from __future__ import annotations

import random

from apr.data.corpus import builtin_corpus_files, stdlib_root
from apr.evaluate.tasks import Example, Task, read_task

NAME = "stdlib-nextline"
CONTEXT_LINES = 6
CHOICES = 4
MIN_CHARS = 12  # a candidate line has at least this many non-space characters
DEFAULT_EXAMPLES = 100


def _candidates(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if i >= 2 and len(line.strip()) >= MIN_CHARS]


def stdlib_nextline(examples: int = DEFAULT_EXAMPLES, seed: int = 0) -> Task:

    rng = random.Random(seed)
    files = builtin_corpus_files("stdlib", max_bytes=2_000_000)
    texts = {}
    for path in files:
        try:
            texts[path] = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
    paths = sorted(p for p, lines in texts.items() if _candidates(lines))
    out: list[Example] = []
    attempts = 0
    while len(out) < examples and attempts < examples * 20:
        attempts += 1
        path = rng.choice(paths)
        lines = texts[path]
        i = rng.choice(_candidates(lines))
        gold = lines[i].rstrip()
        context = "\n".join(lines[max(0, i - CONTEXT_LINES):i]) + "\n"
        if not context.strip():
            continue
        distractors: list[str] = []
        while len(distractors) < CHOICES - 1:
            other = rng.choice(paths)
            if other == path:
                continue
            cand = texts[other][rng.choice(_candidates(texts[other]))].rstrip()
            if cand != gold and cand not in distractors:
                distractors.append(cand)
        choices = distractors + [gold]
        rng.shuffle(choices)
        out.append(Example(context=context, choices=tuple(choices), gold=choices.index(gold),
                           id=f"{path.relative_to(stdlib_root()).as_posix()}:{i + 1}"))
    return Task(name=NAME, examples=out, source="builtin")


BUILTIN_TASKS = {NAME: stdlib_nextline}


def resolve_task(spec: str, on_error: str = "stop", limit: int | None = None, seed: int = 0) -> Task:
    """A built-in task by name, or a JSONL file."""

    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec](limit or DEFAULT_EXAMPLES, seed)
    return read_task(spec, on_error=on_error, limit=limit)
