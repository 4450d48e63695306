"""Helpers for the plan tests: materialise contract examples as real files, run the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from apr.plan.examples import materialize


def plan_for(example: dict, folder: Path):
    """Materialise ``example`` (the contract-example format) under ``folder`` and build its plan."""
    from apr.plan.build import build_plan

    config_path, kwargs = materialize(example, folder)
    return build_plan(config_path, **kwargs)


def result(plan, contract_id: str):
    return next(r for r in plan.results if r.contract.id == contract_id)


def apr_cli(*args: str, cwd: Path | None = None, probe: bool = False) -> subprocess.CompletedProcess:
    """Run the real console entry point in a fresh process (optionally printing heavy modules)."""
    code = ("import sys; from apr.cli.entry import run; sys.argv = ['apr', *sys.argv[1:]]\n"
            "try:\n    run()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n")
    if probe:
        code += ("heavy = [m for m in ('torch', 'textual', 'transformers') if m in sys.modules]\n"
                 "print('HEAVY', heavy, file=sys.stderr)\n")
    code += "sys.exit(code)\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd)
