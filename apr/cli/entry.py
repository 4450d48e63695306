"""Console-script entry point. Kept free of typer so `apr train validate` and `apr runs ls` start fast."""

from __future__ import annotations

import os
import sys

from apr.cli.cmd_train_validate import fast_path


def run() -> None:
    # We use no pydantic plugins; skipping their entry-point scan saves ~40 ms per start.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

    try:
        code = fast_path(sys.argv[1:])
        if code is None:  # `apr runs ls [--global] [--json]`, which agents poll, also skips typer
            from apr.cli.cmd_runs import fast_path as runs_fast_path  # lazy: keeps `runs` off validate's path

            code = runs_fast_path(sys.argv[1:])
        if code is not None:
            sys.stdout.flush()  # here, so a reader that is gone is met inside the try
    except BrokenPipeError:
        reader_gone()
    if code is not None:
        sys.exit(code)
    from apr.cli.main import run as run_full

    run_full()


def reader_gone() -> None:
    """`apr runs ls | head -1`: the reader took what it wanted and left. Exit quietly, as typer's
    commands do (click's exit 1 on EPIPE), with stdout pointed at /dev/null so that Python's own
    flush at exit does not print a BrokenPipeError either."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass
    sys.exit(1)
