"""Console-script entry point. Kept free of typer so `apr train validate` and `apr runs ls` start fast."""

from __future__ import annotations

import os
import sys

from apr.cli.cmd_train_validate import fast_path


def run() -> None:
    # We use no pydantic plugins; skipping their entry-point scan saves ~40 ms per start.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

    code = fast_path(sys.argv[1:])
    if code is None:  # `apr runs ls [--global] [--json]`, which agents poll, also skips typer
        from apr.cli.cmd_runs import fast_path as runs_fast_path  # lazy: keeps `runs` off validate's path

        code = runs_fast_path(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from apr.cli.main import run as run_full

    run_full()
