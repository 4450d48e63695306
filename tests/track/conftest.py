"""Fixtures for the run-record tests: a tiny config, a recorder factory, read-only folders."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from track_helpers import make_config

from apr.config.schema import AprConfig


@pytest.fixture
def config() -> AprConfig:
    return make_config()


@pytest.fixture
def recorder_factory(tmp_path, config):
    """Build RunRecorders in tmp_path (APR_HOME is already private); finishes leftovers."""
    made = []

    def make(output_dir: Path | None = None, cfg: AprConfig | None = None, **kwargs):
        from apr.track.recorder import RunRecorder

        kwargs.setdefault("config_hash", "c0ffee")
        kwargs.setdefault("total_steps", 100)
        kwargs.setdefault("tokens_per_step", 64)
        rec = RunRecorder(output_dir or tmp_path / "run", cfg or config, **kwargs)
        made.append(rec)
        return rec

    yield make
    for rec in made:
        if not rec._finished:
            rec.finish("stopped", "test teardown")


class ReadOnly:
    """Make paths unwritable, also for root (chattr +i), and undo it afterwards."""

    def __init__(self):
        self.paths: list[Path] = []

    def __call__(self, *paths: Path) -> None:
        for p in paths:
            self.paths.append(p)
            p.chmod(0o555 if p.is_dir() else 0o444)
            if os.geteuid() == 0:
                if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(p)]).returncode != 0:
                    pytest.skip("running as root without chattr: cannot make a path read-only")

    def undo(self) -> None:
        for p in reversed(self.paths):
            if os.geteuid() == 0:
                subprocess.run(["chattr", "-i", str(p)], check=False)
            p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.fixture
def read_only():
    ro = ReadOnly()
    yield ro
    ro.undo()
