"""What one apply is asked to do (``ApplyOptions``) and how it ended (``RunResult``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from apr.train.stop import StepHook


@dataclass
class ApplyOptions:
    """How one apply behaves (the config overrides are already in the plan's config)."""

    resume: str | None = None  # None, "latest", or a checkpoint / run directory path
    force: bool = False  # resume although the config changed in a breaking way
    apr_home: Path | None = None
    echo: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    progress: Callable[[int, int], None] | None = None  # called after every step with (step, total_steps)
    handle_signals: bool = True
    overrides: dict = field(default_factory=dict)  # --seed/--device/--max-steps given (recorded in checkpoints)
    hooks: list[StepHook] = field(default_factory=list)  # called after every step (apr.train.stop.StepHook)
    allow_other_run: bool = False  # resume into a folder holding another run's checkpoints (--allow-other-run)
    # the output folder's lock, already taken by apply before it imported torch (apr/train/outdir.py);
    # None: the run takes it itself
    lock: object | None = None
    # ``apr train fork``: the parent run's {"run_id", "step", "run_dir"}; the resumed checkpoint starts a
    # new run (a new id) that records where it came from
    fork_of: dict | None = None


@dataclass
class RunResult:
    status: str  # finished | stopped | failed
    reason: str | None
    run_dir: Path
    run_id: str
    start_step: int
    final_step: int
    total_steps: int
    loss: float | None
    val_loss: float | None
    first_val_loss: float | None
    last_checkpoint: Path | None
    exit_code: int
    tokens_per_s: float | None = None
    warnings: list[str] = field(default_factory=list)
    is_main: bool = True  # rank 0 (or a single process): the one that reports
