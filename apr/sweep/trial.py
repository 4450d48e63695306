"""One trial as a process: `python -m apr train apply BASE KEY=VALUE...` (or under torchrun for
``--nproc-per-trial``), watched through the run's own ``training_state.json`` for the metric's
evaluations, which feed Optuna's pruner.

A trial is a subprocess, not a function call, so that apr's own kill and resume semantics hold
unchanged: a signal reaches apply, which checkpoints and exits 130/143, and a later
``--resume latest`` continues it exactly (docs/checkpoints.md).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apr.errors import AprError
from apr.readers import load_json
from apr.sweep.space import FINAL_EVALUATION

POLL_S = 0.25
LOCKED_RETRY_S = 120.0  # an orphaned apply of a killed sweep may still be checkpointing: wait for its lock


def setting_args(settings: dict[str, Any]) -> list[str]:
    """``KEY=VALUE`` arguments; values as JSON (a YAML subset), so a string stays a string and a float
    round-trips exactly (repr), which is what makes a trial reproducible from its settings."""
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def apply_command(base: Path, settings: dict[str, Any], *, resume: bool, nproc: int = 1) -> list[str]:
    args = ["-m", "apr", "train", "apply", str(base), *setting_args(settings)]
    if resume:
        args += ["--resume", "latest"]
    if nproc > 1:
        # torchrun's own -m: each rank runs `python -m apr ...`
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return [sys.executable, *args]


def has_checkpoint(run_dir: Path) -> bool:
    return any(run_dir.glob("checkpoint-step-*.json"))


def read_run_state(run_dir: Path) -> dict | None:
    """The run's training_state.json, or None while it is absent or unreadable (a reader never
    sees half a file: it is replaced atomically)."""
    try:
        doc = load_json(run_dir / "training_state.json", "state", "state file")
    except AprError:
        return None
    return doc if isinstance(doc, dict) else None


def metric_history(state: dict, metric: str) -> list[tuple[int, float]]:
    """(step, value) of every recorded evaluation of ``metric`` after step 0 (step 0 is the untrained
    model: no pruning decision comes from it)."""
    key = "loss_history" if metric == "loss" else "val_loss_history"
    rows = []
    for item in state.get(key) or []:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and item[0] > 0:
            value = item[1]
            if isinstance(value, (int, float)) and math.isfinite(value):
                rows.append((item[0], math.exp(value) if metric == "val_ppl" else float(value)))
    return rows


def final_metric(state: dict | None, metric: str) -> float | None:
    value = None if state is None else state.get(metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass
class Outcome:
    exit_code: int
    pruned_at: tuple[int, int, float] | None = None  # (evaluation, step, value)
    interrupted: int | None = None  # the signal the worker received
    locked: bool = False  # apply refused: another process held the run's folder
    taken: bool = False  # the trial was failed in storage meanwhile (a stale heartbeat): its run was stopped


class TrialProcess:
    """Start apply, poll its state file, report each new evaluation to ``trial`` and stop the run
    when Optuna's pruner says so. ``stop_signal`` is polled: the worker's own signal handler sets it."""

    def __init__(self, command: list[str], run_dir: Path, log_path: Path, metric: str, interval: int):
        self.command, self.run_dir, self.log_path = command, run_dir, log_path
        self.metric, self.interval = metric, max(interval, 1)
        self.proc: subprocess.Popen | None = None
        self._final_told = False

    def evaluation_of(self, step: int) -> int:
        """The pruner's resource: W&B's iteration, i.e. the metric's evaluation count (the last step's
        evaluation, off the interval, counts as the next one)."""
        return -(-step // self.interval)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # handed to the child, closed below
        try:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent,
                                         env={**os.environ, "NO_COLOR": "1"})
        finally:
            log.close()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # apply and, under torchrun, every rank
            except ProcessLookupError:
                pass

    def run(self, trial, stop_signal, reported: frozenset = frozenset()) -> Outcome:
        """Run to the end; ``trial`` is the Optuna trial (None: no pruning); ``stop_signal()`` returns
        the signal the worker got, if any; ``reported``: evaluations told before a resume."""
        from optuna.exceptions import UpdateFinishedTrialError

        self.start()
        reported = set(reported)
        pruned = None
        forwarded = None
        taken = False
        while self.proc.poll() is None:
            time.sleep(POLL_S)
            sig = stop_signal()
            if sig is not None and forwarded is None:
                forwarded = sig
                self.signal(sig)
            if trial is not None and pruned is None and forwarded is None and not taken:
                try:
                    pruned = self._report(trial, reported)
                except UpdateFinishedTrialError:  # another worker failed it (stale heartbeat) and retries it
                    taken = True
                    self.signal(signal.SIGTERM)
                if pruned is not None:
                    self.signal(signal.SIGTERM)  # apply checkpoints and stops (exit 143)
        if trial is not None and pruned is None and forwarded is None and not taken:
            try:
                pruned = self._report(trial, reported, final=True)
            except UpdateFinishedTrialError:
                taken = True
        return Outcome(self.proc.returncode, pruned_at=pruned, interrupted=forwarded,
                       locked=self.proc.returncode == 1 and self._refused_as_locked(), taken=taken)

    def _report(self, trial, reported: set[int], final: bool = False) -> tuple[int, int, float] | None:
        state = read_run_state(self.run_dir)
        if state is None:
            return None
        total = state.get("total_steps")
        if isinstance(total, int) and total > 0 and not self._final_told:  # the forecast pruner's horizon
            trial.set_user_attr(FINAL_EVALUATION, self.evaluation_of(total))
            self._final_told = True
        for step, value in metric_history(state, self.metric):
            evaluation = self.evaluation_of(step)
            if evaluation in reported:
                continue
            reported.add(evaluation)
            trial.report(value, evaluation)
            if not final and trial.should_prune():
                return evaluation, step, value
        return None

    def _refused_as_locked(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                return b"apply.output_dir_locked" in f.read()
        except OSError:
            return False


def log_tail_reason(log_path: Path) -> str | None:
    """The last ``error...`` line apply printed: the reason of a failed trial."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("error") or line.startswith("Traceback"):
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else None


def _die_with_parent() -> None:
    """In the child: receive SIGTERM when the worker dies, even by SIGKILL (Linux prctl), so a killed
    sweep leaves no trainer running on its own; apply then checkpoints and exits as for any SIGTERM."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
