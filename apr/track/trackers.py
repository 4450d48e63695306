"""External tracker sinks (`monitoring.sinks`): the run's metric rows, also written to TensorBoard.

The recorder hands each sink the same rows it writes to its SQLite stores, on its background
thread (apr/track/recorder.py), so a slow or broken tracker never blocks a step; a sink that
fails is closed, warned about once, and the run goes on. One run keeps one tracker run across
resumes: TensorBoard logs to ``<dir>/<experiment>/<run_id>``, and a resumed process purges events
past its checkpoint's step before it appends (the steps the killed process logged after it), so
the curve has each step once. docs/runs.md ("Tracker sinks") is the user's page.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from apr.config.schema import SinkConfig

EXTRA = "sinks"  # pip install 'apr[sinks]'
PACKAGES = {"tensorboard": "tensorboard"}  # sink type -> the package it needs


def missing_package(sink_type: str) -> str | None:
    """The package a sink type needs when it is not installed (torch-free: a spec lookup)."""
    package = PACKAGES[sink_type]
    try:
        return None if importlib.util.find_spec(package) is not None else package
    except (ImportError, ValueError):
        return package


def sink_dir(sink: SinkConfig, output_dir: Path) -> Path:
    return Path(sink.dir) if sink.dir else Path(output_dir) / str(sink.type)


class TensorBoardSink:
    """Scalars under their apr metric names (``loss``, ``lr``, ``val_loss``, ``eval.<task>.acc`` ...)."""

    def __init__(self, root: Path, experiment: str, run_id: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is an optional extra

        self.log_dir = Path(root) / experiment / run_id
        # purge_step: events of this run at or after the step it resumes from are hidden, as the
        # stores drop metrics recorded after the checkpoint
        self.writer = SummaryWriter(log_dir=str(self.log_dir),
                                    purge_step=None if resume_step is None else int(resume_step) + 1)

    def write(self, rows: list[tuple]) -> None:
        for _run_id, step, key, value, t in rows:
            if value is not None:
                self.writer.add_scalar(key, value, global_step=int(step), walltime=t)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_sink(sink: SinkConfig, output_dir: Path, experiment: str, run_id: str, resume_step: int | None):
    if str(sink.type) == "tensorboard":
        return TensorBoardSink(sink_dir(sink, output_dir), experiment, run_id, resume_step)
    raise ValueError(f"unknown sink type {sink.type}")
