"""`training_state.json`: the live record of a run, atomically replaced, read by the monitor and agents.

The writer (`RunState`) keeps scalar fields plus bounded histories and renders the whole document
as JSON bytes; `apr.track.recorder` writes those bytes with `apr.fsutil.atomic_write_bytes`
(temp file in the same folder, fsync, rename), so a reader sees the old file or the new one, never
a torn one. The format is documented in docs/training-state.md; fields are only ever added.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from apr.errors import AprError, Finding
from apr.readers import load_json

STATE_FILE = "training_state.json"
SCHEMA_VERSION = 1
HISTORY_POINTS = 512  # per history, the first and the latest points included
MAX_ALERTS = 50
MAX_EVENTS = 50  # skipped bad steps and rollbacks kept in the file (the stores keep all)
KEPT_ON_RESUME = ("steer_rejected",)  # events a resumed process does not record again (its request was moved)
STATUSES = ("starting", "running", "finished", "failed", "stopped")
ACTIVE_STATUSES = ("starting", "running")
STALE_AFTER_S = 120.0  # the floor of the stale threshold; see stale_threshold()

HISTORY_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s")
# monitoring.block_norms (apr/train/blocknorms.py): lists indexed by block, and scalars; the latest
# log step's go in the ``block_norms`` field, every log step's in the stores (lists as key.<index>)
BLOCK_NORM_LISTS = ("block_grad_norm", "block_update_norm")
BLOCK_NORM_SCALARS = ("embed_grad_norm", "embed_update_norm", "head_grad_norm", "head_update_norm",
                      "max_block_grad_norm", "max_block_update_norm")
BLOCK_NORM_KEYS = BLOCK_NORM_LISTS + BLOCK_NORM_SCALARS
# model.architecture.moe (apr/train/losses.py RoutingBalance): the latest log step's in the ``moe`` field
MOE_KEYS = ("moe_balance_loss", "moe_expert_load", "moe_max_expert_load")
# monitoring.data_drift (apr/train/datadrift.py): token ranks' figures, then document lengths'
DATA_DRIFT_KEYS = tuple(f"data_drift_{feature}{figure}" for feature in ("", "doc_length_")
                        for figure in ("psi", "ks", "wasserstein"))
EVAL_HISTORY = 24  # evaluations whose task scores the state file keeps (the monitor's evals panel)


def _finite(value: Any) -> float | None:
    """``value`` as a float, or None when it is missing, not a number, NaN or infinite."""
    if value is None or isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class History:
    """A ``[[step, value], ...]`` series bounded to ``max_points`` by decimation.

    Points are kept at a stride of 1, 2, 4, ... (by arrival order): when the kept list is full,
    every other point is dropped and the stride doubles, so the kept points stay evenly spread
    over the whole run. The first point is always kept, and the latest point is always shown.
    Each kept point's JSON text is cached, so rendering costs a join, not a re-serialisation.
    """

    def __init__(self, max_points: int = HISTORY_POINTS):
        if max_points < 3:
            raise ValueError("max_points must be at least 3")
        self.max_points = max_points
        self.stride = 1
        self._seen = 0  # points offered so far (finite ones)
        self._kept: list[str] = []  # JSON text of kept points, "[step,value]"
        self._kept_steps: list[int] = []
        self._latest: str | None = None  # JSON text of the latest point when it is not kept
        self._latest_step: int | None = None

    def __len__(self) -> int:
        return len(self._kept) + (self._latest is not None)

    def add(self, step: int, value: Any) -> None:
        v = _finite(value)
        if v is None:
            return  # JSON has no NaN; a non-finite value shows as the scalar field's null instead
        if self._latest_step is not None and step <= self._latest_step or (
            self._kept_steps and step <= self._kept_steps[-1]
        ):
            self.truncate_after(step - 1)  # a step repeated or going back (resume): replace, keep order
        text = f"[{int(step)},{v!r}]"
        index = self._seen
        self._seen += 1
        if index % self.stride == 0:
            self._kept.append(text)
            self._kept_steps.append(int(step))
            self._latest = None
            self._latest_step = None
            if len(self._kept) >= self.max_points:  # keep room for a separate latest point
                self._kept = self._kept[::2]
                self._kept_steps = self._kept_steps[::2]
                self.stride *= 2
        else:
            self._latest = text
            self._latest_step = int(step)

    def truncate_after(self, step: int) -> None:
        """Drop points with a step greater than ``step`` (a resumed run replays those steps)."""
        if self._latest_step is not None and self._latest_step > step:
            self._latest = None
            self._latest_step = None
        while self._kept_steps and self._kept_steps[-1] > step:
            self._kept.pop()
            self._kept_steps.pop()
        # Re-derive the arrival counter so later points keep the same stride pattern.
        self._seen = (len(self._kept_steps) - 1) * self.stride + 1 if self._kept_steps else 0
        if self._latest is not None:
            self._seen += 1

    def extend(self, points: list) -> None:
        for p in points:
            if isinstance(p, (list, tuple)) and len(p) == 2:
                try:
                    self.add(int(p[0]), p[1])
                except (TypeError, ValueError):
                    continue

    def to_json(self) -> str:
        parts = self._kept if self._latest is None else [*self._kept, self._latest]
        return "[" + ",".join(parts) + "]"

    def points(self) -> list[list]:
        return json.loads(self.to_json())


class RunState:
    """The fields of ``training_state.json`` and its bounded histories, rendered on demand."""

    def __init__(self, **fields: Any):
        self.fields: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "run_id": None,
            "experiment": None,
            "status": "starting",
            "status_reason": None,
            "pid": None,
            "host": None,
            "started_at": None,
            "heartbeat": None,
            "ended_at": None,
            "step": 0,
            "total_steps": None,
            "epoch": None,
            "loss": None,
            "val_loss": None,
            "val_ppl": None,
            "lr": None,
            "grad_norm": None,
            "tokens_per_s": None,
            "mfu": None,  # on a catalogue GPU (apr/train/mfu.py); null elsewhere
            "hfu": None,
            "tokens_seen": 0,
            "tokens_total": None,
            "elapsed_s": 0.0,
            "eta_s": None,
            "cost": None,  # {price_per_gpu_hour, gpus, spent, projected} with training.price_per_gpu_hour
            "last_checkpoint": None,
            "gpu": None,
            "alerts": [],
            "events": [],  # skipped bad steps and rollbacks, with the rows they skipped (docs/training-state.md)
            "drift": None,  # the run against its plan after monitoring.drift_after_steps (apr/train/drift.py)
            "mixture": None,  # a data mixture's stage and tokens/rows/epochs/val loss per source (mixloader.py)
            "store_warnings": [],
            "output_dir": None,
            "config_path": None,
            "model_params": None,
            "log_period_s": None,
            "evals": None,  # in-training task scores (evaluation.tasks), latest per task
            "samples": None,  # the latest sample generations (evaluation.samples)
            "block_norms": None,  # the latest per-block gradient and update norms (monitoring.block_norms)
            "moe": None,  # the latest routing figures of a mixture of experts (model.architecture.moe)
            "data_drift": None,  # read-so-far against rows-ahead drift (monitoring.data_drift)
            "histograms": None,  # the latest per-layer weight and gradient histograms (monitoring.histograms)
            "eval_history": [],  # task scores of each evaluation, the last EVAL_HISTORY (the monitor's evals panel)
        }
        self.fields.update(fields)
        self.histories = {key: History() for key in HISTORY_KEYS}

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.fields[key] = value

    def add_alert(self, entry: dict) -> None:
        alerts = self.fields["alerts"]
        alerts.append(entry)
        del alerts[:-MAX_ALERTS]

    def add_event(self, entry: dict) -> None:
        events = self.fields["events"]
        events.append(entry)
        del events[:-MAX_EVENTS]

    def drop_events_after(self, step: int, recorded_after: float | None = None) -> None:
        """Steps after ``step`` will be trained again (a resume or a rollback): their ``bad_step``
        and ``steer`` events go (a replayed step that is flagged again records again; a resume replays
        a steer at its step and records it again); rollbacks stay, since
        the checkpoint the run goes on from holds their decision. ``recorded_after`` (a resume: the
        time of the newest event its checkpoint had seen) also drops every event recorded later (the
        resumed process records them again), but a rejected steer request (not replayed)."""
        self.fields["events"] = [e for e in self.fields["events"]
                                 if not (e.get("kind") in ("bad_step", "steer") and (e.get("step") or 0) > step)
                                 and not _recorded_after(e, recorded_after)]

    def carry_over(self, previous: dict, upto_step: int | None) -> None:
        """Adopt a previous state of the same run (resume): its histories up to ``upto_step``,
        its start time, elapsed time, alerts and last checkpoint."""
        for key in HISTORY_KEYS:
            points = previous.get(f"{key}_history") or []
            if upto_step is not None:
                points = [p for p in points if isinstance(p, list) and p and p[0] <= upto_step]
            self.histories[key].extend(points)
        for key in ("started_at", "last_checkpoint"):
            if previous.get(key) is not None:
                self.fields[key] = previous[key]
        if isinstance(previous.get("alerts"), list):
            self.fields["alerts"] = list(previous["alerts"])[-MAX_ALERTS:]
        if isinstance(previous.get("events"), list):
            self.fields["events"] = list(previous["events"])[-MAX_EVENTS:]

    def to_json_bytes(self) -> bytes:
        """The document, one top-level key per line (readable with `cat`), histories compact.
        Rendered at every log step, so it avoids per-call `json.dumps` set-up (~0.1 ms a write)."""
        lines = []
        for key, value in self.fields.items():
            prefix = _KEY_PREFIX.get(key) or _KEY_PREFIX.setdefault(key, _encode(key) + ": ")
            lines.append(prefix + _encode_value(value))
        for key in HISTORY_KEYS:
            lines.append(f'"{key}_history": {self.histories[key].to_json()}')
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode("utf-8")


def _recorded_after(event: dict, mark: float | None) -> bool:
    return (mark is not None and event.get("kind") not in KEPT_ON_RESUME
            and isinstance(event.get("time"), (int, float)) and event["time"] > mark)


_encode = json.JSONEncoder(default=str, allow_nan=False).encode
_KEY_PREFIX: dict[str, str] = {}


def _without_nan(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nan(v) for v in value]
    return value


def _encode_value(value: Any) -> str:
    """JSON text of one field; NaN and infinities anywhere inside become null (JSON has neither)."""
    if value is None:
        return "null"
    try:
        return _encode(value)
    except ValueError:
        return _encode(_without_nan(value))


# ------------------------------------------------------------------------------------- reading


def state_path(run_dir: str | Path) -> Path:
    """``run_dir/training_state.json``; a path that already names a .json file is returned as is."""
    p = Path(run_dir)
    return p if p.suffix == ".json" and not p.is_dir() else p / STATE_FILE


def read_state(run_dir: str | Path) -> dict:
    """Parse a run's ``training_state.json``. Raises AprError when it is missing or malformed."""

    path = state_path(run_dir)
    if not os.path.lexists(path):
        raise AprError(f"no {STATE_FILE} in {path.parent}", [Finding(
            "error", "track.state_missing",
            f"{path} does not exist: not a run directory, or the run has not started yet", file=str(path))])
    try:
        doc = load_json(path, "state", "state file", error=AprError)  # bounded: size, nesting, FIFOs
    except AprError as e:
        f = e.findings[0]
        code = "track.state_malformed" if f.code in ("file.json", "file.too_deep", "file.encoding") \
            else "track.state_unreadable"
        raise AprError(e.message, [Finding(f.severity, code, f.message, path=f.path, file=f.file, line=f.line,
                                           column=f.column, expected=f.expected, got=f.got)]) from None
    if not isinstance(doc, dict):
        raise AprError(
            f"{path} is not a JSON object",
            [Finding("error", "track.state_malformed", "expected a JSON object", file=str(path),
                     expected="object", got=type(doc).__name__)],
        )
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise AprError(
            f"{path} has no valid schema_version",
            [Finding("error", "track.state_malformed", "missing or invalid schema_version", file=str(path),
                     path="schema_version", expected="an integer >= 1", got=repr(version))],
        )
    if version > SCHEMA_VERSION:
        raise AprError(
            f"{path} was written by a newer apr (schema_version {version})",
            [Finding("error", "track.state_version", "written by a newer apr; upgrade apr to read it",
                     file=str(path), path="schema_version", expected=f"<= {SCHEMA_VERSION}", got=str(version))],
        )
    return doc


def stale_threshold(record: dict) -> float:
    """Seconds without a heartbeat after which an active run counts as dead: at least
    STALE_AFTER_S, and at least 10 typical gaps between its writes (slow steps are not death)."""
    period = _finite(record.get("log_period_s")) or 0.0
    return max(STALE_AFTER_S, 10.0 * period)


def is_stale(state: dict, now: float | None = None, threshold_s: float | None = None) -> bool:
    """True when ``state`` says starting/running but its heartbeat is older than the threshold
    (its process died without recording an end). ``threshold_s`` None: `stale_threshold`."""
    if state.get("status") not in ACTIVE_STATUSES:
        return False
    heartbeat = _finite(state.get("heartbeat"))
    if heartbeat is None:
        return False
    now = time.time() if now is None else now
    limit = stale_threshold(state) if threshold_s is None else threshold_s
    return now - heartbeat > limit


def effective_status(state: dict, now: float | None = None, threshold_s: float | None = None) -> str:
    """The recorded status, or ``"stale"`` when `is_stale` says the process behind it is gone."""
    return "stale" if is_stale(state, now, threshold_s) else str(state.get("status"))
