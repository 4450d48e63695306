"""docs/runs.md and docs/training-state.md stay current: every field, key, table and flag the code
has is documented."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import click
import pytest
import typer

from apr.cli.main import app
from apr.track.state import HISTORY_KEYS, RunState
from apr.track.store import StoreWriter

DOCS = Path(__file__).resolve().parents[2] / "docs"




def test_every_state_field_is_documented():
    fields = set(RunState().fields) | {f"{k}_history" for k in HISTORY_KEYS}
    table = set(re.findall(r"^\| `([a-z_]+)` \|", (DOCS / "training-state.md").read_text(), re.M))
    assert fields <= table, sorted(fields - table)
    assert table - fields <= {"name", "utilization", "memory_used", "memory_total", "temperature", "power_w"}


def test_every_store_table_and_column_is_documented(tmp_path):
    w = StoreWriter(tmp_path / "experiments.db")
    w.open()
    w.close()
    conn = sqlite3.connect(tmp_path / "experiments.db")
    text = (DOCS / "runs.md").read_text()
    for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
        assert f"| `{table}` |" in text, table
        row = next(line for line in text.splitlines() if line.startswith(f"| `{table}` |"))
        for col in conn.execute(f"PRAGMA table_info({table})"):
            assert f"`{col[1]}`" in row, (table, col[1])
    conn.close()


def test_every_runs_ls_and_show_key_is_documented(tmp_path):
    from apr.track.runs import summarize

    text = (DOCS / "runs.md").read_text()
    keys = set(summarize({}, tmp_path, 0.0)) | {"run", "params", "final_metrics", "best_val_loss", "artifacts",
                                                "checkpoints", "status_history", "alerts", "tags"}
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, missing


def _options(path: list[str]) -> set[str]:
    command = typer.main.get_command(app)
    ctx = click.Context(command)
    for name in path:
        command = command.get_command(ctx, name)
        ctx = click.Context(command, parent=ctx)
    return {opt for p in command.params if isinstance(p, click.Option) for opt in p.opts if opt != "--help"}


@pytest.mark.parametrize("path, doc", [(["runs", "ls"], "runs.md"), (["runs", "show"], "runs.md"),
                                       (["experiment", "view"], "runs.md"), (["experiment", "export"], "runs.md"),
                                       (["monitor"], "monitor.md")])
def test_every_flag_is_documented(path, doc):
    text = (DOCS / doc).read_text()
    missing = [opt for opt in sorted(_options(path)) if f"{opt}" not in text]
    assert not missing, missing
