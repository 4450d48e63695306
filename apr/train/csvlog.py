"""``monitoring.csv_log``: ``<output_dir>/metrics.csv``, one row per logged or validated step, written
as the run goes (docs/runs.md, "The run directory").

``CsvLog`` wraps the run's recorder (rank 0's ``RunRecorder``) and sees what it records: a log
step's metrics (``log_step``) and a validation loss (``log_eval``). A step's row is complete when
the run records another step, a checkpoint, a rewind or its end; it is then appended with one
``write`` on a file opened for appending, so a reader never sees half a row. The file holds the
trajectory of the weights the run has now:

- a fresh run starts the file anew;
- a resume keeps the rows up to its checkpoint's step and drops later ones, which the interrupted
  process wrote and the resumed one trains again (no step twice);
- a rollback (``rewind``) drops the rows after the step it went back to.

Those rewrites replace the file atomically. A line the interrupted process left half-written is
dropped with them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from apr.errors import AprError, Finding
from apr.fsutil import atomic_write_text

CSV_LOG = "metrics.csv"
COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "epoch")
HEADER = ",".join(COLUMNS) + "\n"


class CsvLog:
    """The run's recorder, with ``metrics.csv`` written beside what it records."""

    def __init__(self, inner, run_dir: Path):
        self._inner = inner
        self.path = Path(run_dir) / CSV_LOG
        self._fd: int | None = None
        self._pending: dict[str, Any] | None = None  # the step whose row may still get its val_loss

    def __getattr__(self, name: str):  # everything else is the recorder's
        return getattr(self._inner, name)

    # ------------------------------------------------------------------ what the CSV follows

    def start(self, resume_step: int | None = None) -> None:
        self._keep_until(-1 if resume_step is None else int(resume_step))
        self._inner.start(resume_step)

    def log_step(self, step: int, metrics: dict) -> None:
        self._inner.log_step(step, metrics)
        row = self._row_for(int(step))
        row.update({k: metrics.get(k) for k in COLUMNS if k not in ("step", "val_loss")})

    def log_eval(self, step: int, val_loss: float) -> None:
        self._inner.log_eval(step, val_loss)
        self._row_for(int(step))["val_loss"] = val_loss

    def checkpoint(self, step: int, path: Path, is_best: bool = False) -> None:
        self._write_pending()
        self._inner.checkpoint(step, path, is_best)

    def rewind(self, step: int) -> None:
        self._write_pending()
        self._keep_until(int(step))
        self._inner.rewind(step)

    def flush(self, timeout: float | None = 120.0) -> None:
        self._write_pending()
        self._inner.flush(timeout)

    def finish(self, status: str, reason: str | None = None) -> None:
        try:
            self._write_pending()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._inner.finish(status, reason)

    # ------------------------------------------------------------------ the file

    def _row_for(self, step: int) -> dict[str, Any]:
        if self._pending is not None and self._pending["step"] != step:
            self._write_pending()
        if self._pending is None:
            self._pending = {"step": step}
        return self._pending

    def _write_pending(self) -> None:
        row, self._pending = self._pending, None
        if row is None:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.write(self._fd, (",".join(_cell(row.get(k)) for k in COLUMNS) + "\n").encode())

    def _keep_until(self, step: int) -> None:
        """Replace the file (atomically) by its header and its whole rows up to ``step``."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        kept = []
        if step >= 0 and self.path.is_file():
            text = self.path.read_text(encoding="utf-8", errors="replace")
            for line in text.splitlines(keepends=True)[1:]:
                first = line.split(",", 1)[0]
                if line.endswith("\n") and first.isdigit() and int(first) <= step:
                    kept.append(line)
        atomic_write_text(self.path, HEADER + "".join(kept))


def refuse_foreign_csv(run_dir: Path) -> None:
    """A ``metrics.csv`` in the output folder that apr did not write (its first line is not apr's
    header) is the user's: refused before the run records anything, never overwritten."""
    path = Path(run_dir) / CSV_LOG
    if os.path.lexists(path) and not _is_ours(path):
        raise AprError(f"{path} is not a CSV log apr wrote; monitoring.csv_log writes {CSV_LOG} there and will not "
                       "overwrite yours", [Finding(
                           "error", "apply.output_dir_record", f"{CSV_LOG} is not apr's", path="monitoring.csv_log",
                           file=str(path), expected=f"no {CSV_LOG}, or one apr wrote (first line: {HEADER.strip()})",
                           got="another file")])


def _cell(value: Any) -> str:
    if value is None or isinstance(value, (list, tuple, dict)):
        return ""
    if isinstance(value, (bool, int)):
        return str(int(value))
    return repr(float(value))  # the shortest text that reads back as the same float; nan, inf as such


def _is_ours(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline(len(HEADER) + 1) == HEADER
    except OSError:
        return False
