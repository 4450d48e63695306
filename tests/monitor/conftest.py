"""Fixtures for the monitor tests: recorded states, a fixed clock, a small global registry."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_NOW = 1_795_000_000.0  # the clock the recorded states were written for (make_fixtures.py)
FIXTURE_NAMES = ("starting", "mid_run", "finished", "failed", "stale")


def fixed_clock() -> float:
    return FIXTURE_NOW


def tiny_config(alerts: list | None = None):
    """A valid config for driving a RunRecorder (no training happens)."""
    from apr.config.schema import AprConfig

    return AprConfig.model_validate({
        "model": {"architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}},
        "data": {"train": "data/train", "batch_size": 2, "seq_len": 32},
        "monitoring": {"system": {"enabled": False}, "alerts": alerts or []},
    })


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """An empty run directory (no state file yet)."""
    d = tmp_path / "run"
    d.mkdir()
    return d


def copy_fixture(name: str, dest: Path) -> Path:
    """Copy a recorded state into ``dest`` (a run directory) and return the state file."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "training_state.json"
    shutil.copyfile(FIXTURES / name / "training_state.json", target)
    return target


def make_registry(db: Path, rows: list[dict]) -> Path:
    """A global registry with the columns the monitor relies on (id, experiment, status,
    output_dir, started)."""
    db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db)
    conn.execute(
        "CREATE TABLE runs (id TEXT PRIMARY KEY, experiment TEXT, status TEXT, output_dir TEXT, started REAL)"
    )
    conn.executemany(
        "INSERT INTO runs (id, experiment, status, output_dir, started) "
        "VALUES (:id, :experiment, :status, :output_dir, :started)",
        rows,
    )
    conn.commit()
    conn.close()
    return db
