"""A run's output folder: one writer at a time, and never over another run's files.

``OutputDirLock`` holds an exclusive ``flock`` on ``<output_dir>/.apr-run.lock`` for the life of a
run (apply and resume alike). It sits in the output folder itself, which a run must be able to
write, not in ``.apr/``, whose store is best-effort and may be unwritable. The kernel drops it
when the process ends, however it ends, so a
``kill -9`` never leaves a stale lock; the file itself stays (removing it would let two writers
lock two different files). It holds the holder's pid, host and start time, which a refused second
writer names. ``refuse_foreign_files`` keeps a fresh run out of a folder holding another run's
checkpoints; ``refuse_user_records`` keeps any run off a ``config.yaml``, ``training_state.json``,
``plan.json`` or lock file that apr did not write; ``refuse_resume_over_other_run`` keeps a resume
allowed into another run's folder (``--allow-other-run``) off that run's records and checkpoint
names. docs/training.md, "The output folder".
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from pathlib import Path

from apr.checkpoint import files
from apr.errors import AprError, Finding
from apr.readers import load_json
from apr.track.names import PLAN_FORMAT

LOCK_FILE = Path(".apr-run.lock")
RESOLVED_CONFIG = "config.yaml"
RESOLVED_CONFIG_HEADER = "# resolved config of this run"  # the first line of every config.yaml apr writes
CHECKPOINT_FILE_RE = re.compile(r"^checkpoint-(step-\d+|best)\.(json|safetensors)$")


def _in_use(message: str, config_path: Path, code: str, detail: str) -> AprError:
    return AprError(message, [Finding("error", code, detail, path="training.output_dir", file=str(config_path))])


class OutputDirLock:
    """An exclusive, process-lifetime lock on one output folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, config_path: Path) -> None:
        """Take the lock or raise AprError naming the process that holds it."""
        if self._file is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+", encoding="utf-8")  # never truncates another holder's record
        except OSError as err:
            raise _in_use(f"cannot lock the output folder: {self.path}: {err.strerror or err}", config_path,
                          "apply.output_dir_unwritable",
                          "training.output_dir must be a folder this user can write") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe(f.read(4096))
            f.close()
            raise _in_use(
                f"{self.run_dir} is in use by another apr run ({holder}); one output folder takes one "
                "writer at a time", config_path, "apply.output_dir_locked",
                f"locked by {holder}: wait for that run to end (or stop it), or choose another "
                "training.output_dir") from None
        except BaseException:
            f.close()
            raise
        f.seek(0)
        previous = f.read(4097)
        if previous.strip() and not _is_lock_record(previous):
            f.close()  # a file of the user's under the lock's name: never truncated
            raise _in_use(f"{self.path} is not a lock apr wrote; apr will not overwrite it", config_path,
                          "apply.output_dir_record", f"move {LOCK_FILE} out of the output directory, or "
                          "choose another training.output_dir")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            try:
                self._file.close()  # closing the descriptor drops the flock
            finally:
                self._file = None


def _is_lock_record(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and {"pid", "host", "since"} <= set(doc)


def _describe(text: str) -> str:
    try:
        doc = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(doc["since"])))
        return f"pid {int(doc['pid'])} on host {doc['host']}, since {since}"
    except (ValueError, KeyError, TypeError, OverflowError):
        return "a process that has not recorded its pid yet"


def refuse_foreign_files(run_dir: Path, config_path: Path, warn=None) -> None:
    """A fresh run must not write into a folder that holds another run's checkpoints (any step, best,
    complete or not) or a ``config.yaml`` of the user's, which apr would overwrite. A step's weights
    file without its JSON that apr wrote (a run killed while saving) is no checkpoint: it is named
    through ``warn`` (default: the ``apr.train`` logger) and the new run replaces it."""
    try:
        names = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return
    interrupted = set(files.interrupted_saves(run_dir))
    found = [n for n in names if CHECKPOINT_FILE_RE.match(n) and n not in interrupted]
    if found:
        shown = ", ".join(found[:3]) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
        raise _in_use(
            f"{run_dir} already holds checkpoints of an earlier run ({shown})", config_path,
            "apply.output_dir_in_use",
            "the output directory holds checkpoints; continue that run with --resume latest, or choose "
            "another training.output_dir (or move those files away)")
    refuse_user_config(run_dir, config_path)
    if interrupted:
        (warn or logging.getLogger("apr.train").warning)(files.interrupted_message(sorted(interrupted)))


def _apr_json(path: Path, kind: str, check) -> bool:
    """Whether ``path`` is a regular JSON file (bounded read) that ``check(doc)`` recognises as apr's."""
    try:
        return bool(check(load_json(path, kind, "record")))
    except AprError:
        return False


def _is_state(doc) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("schema_version"), int) and "run_id" in doc


def _is_plan(doc) -> bool:
    return isinstance(doc, dict) and doc.get("format") == PLAN_FORMAT


# Record files apr writes into an output folder, and how apr recognises its own: a file of that
# name that apr did not write is the user's, and is never overwritten.
RECORD_FILES = {
    "training_state.json": lambda p: _apr_json(p, "state", _is_state),
    "plan.json": lambda p: _apr_json(p, "plan", _is_plan),
}


def refuse_user_records(run_dir: Path, config_path: Path) -> None:
    """Refuse a run (fresh or resumed) whose output folder holds a file named like one of apr's
    records (``training_state.json``, ``plan.json``, ``config.yaml``) that apr did not write, or
    something that is not a regular file under that name (a folder, a FIFO, a symlink)."""
    for name, is_apr in RECORD_FILES.items():
        target = run_dir / name
        if not os.path.lexists(target):
            continue
        if target.is_file() and not target.is_symlink() and is_apr(target):
            continue
        raise _in_use(
            f"{target} is not a record apr wrote; apr records a run's {name} under that name and will not "
            "overwrite yours", config_path, "apply.output_dir_record",
            f"move {name} out of the output directory, or choose another training.output_dir")
    refuse_user_config(run_dir, config_path, records=False)


def refuse_user_config(run_dir: Path, config_path: Path, records: bool = True) -> None:
    """apr writes the resolved config to ``<output_dir>/config.yaml``; refuse if a file of that name is
    there that apr did not write (its first line is not apr's header). With ``records`` (the default)
    every other record file is checked too (:func:`refuse_user_records`)."""
    if records:
        refuse_user_records(run_dir, config_path)
        return
    target = run_dir / RESOLVED_CONFIG
    if not target.exists() and not target.is_symlink():
        return
    first = ""
    if target.is_file() and not target.is_symlink():
        try:
            with open(target, encoding="utf-8", errors="replace") as f:
                first = f.readline(200)
        except OSError:
            first = ""
    if first.startswith(RESOLVED_CONFIG_HEADER):
        return
    raise _in_use(
        f"{target} is not a config apr wrote; apr records the resolved config of a run under that name and "
        "will not overwrite yours", config_path, "apply.output_dir_config",
        f"move {target.name} out of the output directory, or choose another training.output_dir")


# What a run writes into its output folder besides checkpoints: one of each per folder, so a resume
# into another run's folder would replace that run's copy (its store is the .apr/ folder).
RUN_RECORDS = ("config.yaml", "plan.json", "training_state.json", ".apr")


def _run_id_of(path: Path) -> str | None:
    """The ``run_id`` a record or checkpoint JSON holds (bounded read), None when it holds none."""
    try:
        doc = load_json(path, "state" if path.name == "training_state.json" else "checkpoint", "record")
    except AprError:
        return None
    value = doc.get("run_id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else None


def other_run_checkpoints(run_dir: Path, run_id: str) -> dict[str, str]:
    """Checkpoint JSON name -> run id, for the checkpoints in ``run_dir`` that record a run other
    than ``run_id`` (step checkpoints and checkpoint-best; files without a run id are not counted)."""
    out = {}
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return out
    for name in names:
        if files.STEP_JSON_RE.match(name) or name == f"{files.BEST_STEM}.json":
            rid = _run_id_of(run_dir / name)
            if rid is not None and rid != run_id:
                out[name] = rid
    return out


def planned_saves(start_step: int, total_steps: int, save_interval: int | None) -> set[int]:
    """The steps a run resumed at ``start_step`` saves a step checkpoint at: every ``save_interval``
    steps, and the last step."""
    steps = {total_steps} if total_steps > start_step else set()
    if save_interval and save_interval > 0:
        first = (start_step // save_interval + 1) * save_interval
        steps |= set(range(first, total_steps + 1, save_interval))
    return steps


def refuse_resume_over_other_run(run_dir: Path, config_path: Path, run_id: str | None, *, start_step: int,
                                 total_steps: int, save_interval: int | None, saves_best: bool = True) -> None:
    """A resume of run ``run_id`` into ``run_dir`` that holds another run's checkpoints (allowed by
    ``--allow-other-run``) is refused before anything is written when it would replace that run's
    files: its records (``config.yaml``, ``plan.json``, ``training_state.json``, its ``.apr/``
    store: one per folder, so the resumed run would write over them), its ``checkpoint-best`` or a
    step checkpoint at a step the resumed run saves at (found at the save, after every step was
    trained; ``saves_best``: the run evaluates, so it saves a best). Nothing to refuse in a folder of
    no other run, or with no run id to compare."""
    if run_id is None:
        return
    theirs = other_run_checkpoints(run_dir, run_id)
    if not theirs:
        return
    other = sorted(set(theirs.values()))[0]
    state = run_dir / "training_state.json"
    state_run = _run_id_of(state) if state.is_file() else None
    records = [] if state_run == run_id else [n for n in RUN_RECORDS if os.path.lexists(run_dir / n)]
    if records:
        raise _in_use(
            f"{run_dir} holds run {other}'s records ({', '.join(records)}); resuming run {run_id} there would "
            "write over them", config_path, "resume.other_run_records",
            f"resume run {run_id} into an empty training.output_dir (its own folder, or a new one); run "
            f"{other}'s records are one per folder and are never replaced")
    saves = planned_saves(start_step, total_steps, save_interval)
    clash = sorted(n for n in theirs if (saves_best if n == f"{files.BEST_STEM}.json"
                                         else int(files.STEP_JSON_RE.match(n).group(1)) in saves))
    if clash:
        raise _in_use(
            f"{run_dir} holds run {other}'s {', '.join(clash[:3])}; run {run_id}, resumed at step {start_step}, "
            "would save under the same name, and another run's checkpoint is never replaced", config_path,
            "resume.other_run_clash",
            f"resume run {run_id} into an empty training.output_dir; it would train to the save and then stop")
