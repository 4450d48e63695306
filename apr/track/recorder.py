"""`RunRecorder`: the one object the trainer talks to. It keeps `training_state.json` current, fills
the local store and the global registry, evaluates alerts and samples GPU telemetry.

The training thread only updates in-memory fields and queues rows (microseconds per call); a
background thread renders and atomically writes the state file and writes batches to the stores.
Every store write is best-effort: a store that is missing, read-only, locked or on a full disk gets
one warning (stderr, `rec.warnings`, the state file's `store_warnings`), is retried every
`RETRY_S` seconds with its rows kept, and never stops training.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apr.errors import AprError
from apr.fsutil import atomic_write_bytes
from apr.readers import load_json
from apr.track.alerts import Alert, AlertEvaluator
from apr.track.names import (
    experiment_from_dir,
    global_db_path,
    local_db_path,
    new_run_id,
    validate_experiment,
    validate_run_id,
)
from apr.track.state import BLOCK_NORM_KEYS, EVAL_HISTORY, MOE_KEYS, STATE_FILE, RunState, read_state
from apr.track.store import BUSY_TIMEOUT_S, HISTOGRAMS_EVENT, Batch, StoreWriter, flatten_params
from apr.track.telemetry import gpu_snapshot
from apr.track.trackers import (
    SinkWorker,
    close_workers,
    open_sink,
    run_params,
    sink_target_problems,
    stall_limits,
)

if TYPE_CHECKING:
    from apr.config import AprConfig

__all__ = ["Alert", "RunRecorder"]

FINAL_STATUSES = ("finished", "failed", "stopped")
FLUSH_INTERVAL_S = 5.0  # metrics reach the stores at least this often (and at eval/checkpoint/end)
FLUSH_ROWS = 5000  # ... or as soon as this many rows are waiting
RETRY_S = 30.0  # a failed store is retried after this long
MAX_PENDING_ROWS = 200_000  # per failed store; older rows are dropped beyond this
COALESCE_S = 0.005  # the writer waits this long after a wake-up, then writes the latest state once
STATE_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "epoch", "mfu", "hfu")


def run_cost(training, elapsed_s: float, eta_s: float | None) -> dict | None:
    """The live cost of a run with ``training.price_per_gpu_hour``: the elapsed time (all sessions
    of a resumed run) x the GPUs (``training.world_size``, the real one under torchrun) x the
    price, and that projected to the end at the current ETA. None without a price."""
    price = training.price_per_gpu_hour
    if price is None:
        return None
    per_s = price * training.world_size / 3600
    return {"price_per_gpu_hour": price, "gpus": training.world_size, "spent": elapsed_s * per_s,
            "projected": None if eta_s is None else (elapsed_s + eta_s) * per_s}


def _num(value: Any) -> float | None:
    """A metric value as a float; None for anything that is not a real number. NaN stays NaN."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _file_digest(path: Path) -> tuple[int | None, str | None]:
    """(size, sha256) of a file; for a folder, its total size and no hash; (None, None) if gone."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()), None
        before = path.stat()
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        after = path.stat()
        if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
            return after.st_size, None  # rewritten while we read it: the hash would describe neither
        return after.st_size, digest.hexdigest()
    except OSError:
        return None, None


def _checkpoint_artifacts(run_id: str, path: Path, kind: str, step: int, t: float) -> list[dict]:
    """Artifact rows for one written checkpoint. For an apr checkpoint (its JSON metadata names the
    weights file and their SHA-256), the weights file is the ``kind`` row, with the size and hash
    the checkpoint writer computed (trusted while the file's size still matches, so gigabytes are
    not hashed twice), and the metadata file is a ``checkpoint_meta`` row. Any other path: one row."""

    def row(p: Path, k: str, size: int | None, sha: str | None) -> dict:
        return {"run_id": run_id, "path": str(p), "kind": k, "size": size, "sha256": sha, "step": step, "time": t}

    doc = None
    if path.suffix == ".json":
        try:  # bounded like every file apr reads (docs/design.md, "Bounded reading")
            doc = load_json(path, "checkpoint", "checkpoint metadata")
        except (AprError, OSError):
            doc = None  # not an apr checkpoint we can read: recorded as a plain file
    if not (isinstance(doc, dict) and doc.get("format") == "apr-checkpoint"
            and isinstance(doc.get("weights_file"), str)):
        return [row(path, kind, *_file_digest(path))]
    files = [(doc["weights_file"], doc.get("weights_size"), doc.get("weights_sha256"))]
    if isinstance(doc.get("weights_parts"), list):  # a sharded run's checkpoint: one row per rank's part
        files = [(e.get("file"), e.get("size"), e.get("sha256")) for e in doc["weights_parts"]
                 if isinstance(e, dict) and isinstance(e.get("file"), str)]
    rows = []
    for name, size, sha in files:
        weights = path.parent / Path(name).name
        try:
            on_disk = weights.stat().st_size
        except OSError:
            on_disk = None
        if on_disk is None or on_disk != size or not isinstance(sha, str):
            size, sha = _file_digest(weights)
        rows.append(row(weights, kind, size, sha))
    return [*rows, row(path, "checkpoint_meta", *_file_digest(path))]


# monitoring.system.metrics -> the gpu_snapshot fields each one keeps (the GPU's name is always kept)
_SYSTEM_FIELDS = {"gpu_utilization": ("utilization",), "memory": ("memory_used", "memory_total"),
                  "temperature": ("temperature",), "power": ("power_w",)}


def _only_metrics(snap: dict | None, metrics) -> dict | None:
    """The GPU snapshot with the fields of metrics not asked for set to None (shown as a dash)."""
    if snap is None:
        return None
    keep = {"name"} | {f for m in metrics for f in _SYSTEM_FIELDS[str(m)]}
    return {k: (v if k in keep else None) for k, v in snap.items()}


class _Sink:
    """One store as the recorder sees it: pending rows, registration, failure and retry state."""

    def __init__(self, label: str, path: Path, busy_timeout_s: float):
        self.label = label
        self.path = path
        self.writer = StoreWriter(path, busy_timeout_s=busy_timeout_s)
        self.registered = False
        self.pending = Batch(run={})
        self.failed = False
        self.warned = False
        self.retry_at = 0.0

    def add(self, metrics: list, status: list, alerts: list, artifacts: list, events: list = (),
            rewind: int | None = None, row_losses: list = ()) -> None:
        p = self.pending
        if rewind is not None:  # rows of the abandoned steps still pending are dropped with the stored ones
            p.metrics = [m for m in p.metrics if m[1] <= rewind]
            p.row_losses = [r for r in p.row_losses if r[1] <= rewind]
            p.rewind = rewind if p.rewind is None else min(p.rewind, rewind)
        p.metrics.extend(metrics)
        p.row_losses.extend(row_losses)
        if len(p.row_losses) > MAX_PENDING_ROWS:  # a store that keeps failing: the oldest steps' rows go
            del p.row_losses[: len(p.row_losses) - MAX_PENDING_ROWS]
        p.events.extend(events)
        p.status.extend(status)
        p.alerts.extend(alerts)
        p.artifacts.extend(artifacts)
        if len(p.metrics) > MAX_PENDING_ROWS:
            del p.metrics[: len(p.metrics) - MAX_PENDING_ROWS]

    def sync(self, run: dict, register: dict, force: bool, now: float) -> str | None:
        """Write pending rows. Returns a warning text on this store's first failure, else None."""
        if self.failed and not force and now < self.retry_at:
            return None
        p = self.pending
        p.run = run
        p.register = None if self.registered else register
        try:
            self.writer.write(p)
        except Exception as e:  # sqlite3.Error, OSError, StoreError: all mean "not now"
            self.writer.close()
            self.failed = True
            self.retry_at = now + RETRY_S
            if self.warned:
                return None
            self.warned = True
            return (
                f"{self.label} experiment store {self.path}: {type(e).__name__}: {e}; "
                f"training continues, retrying every {RETRY_S:.0f} s"
            )
        self.registered = True
        self.failed = False
        self.pending = Batch(run={})
        return None

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


class RunRecorder:
    """Records one run. See docs/runs.md and docs/training-state.md for what lands where."""

    def __init__(
        self,
        output_dir: Path,
        config: AprConfig,
        *,
        config_hash: str,
        total_steps: int,
        tokens_per_step: int,
        run_id: str | None = None,
        experiment: str | None = None,
        apr_home: Path | None = None,
        config_path: str | None = None,
        model_params: int | None = None,
        plan: dict | None = None,
        enabled: bool = True,
        background: bool = True,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        events_after: float | None = None,
    ):
        self.output_dir = Path(output_dir).resolve()
        self._events_after = events_after  # a resume: the newest event its checkpoint had seen (``events_mark``)
        self.config = config
        tracking = config.monitoring.tracking
        self.run_id = validate_run_id(run_id) if run_id else new_run_id()
        self.experiment = validate_experiment(experiment or tracking.experiment or experiment_from_dir(output_dir))
        self.config_hash = config_hash
        self.total_steps = int(total_steps)
        self.tokens_per_step = int(tokens_per_step)
        self.flush_interval_s = flush_interval_s
        self._alerts = AlertEvaluator(list(config.monitoring.alerts))
        self._system = config.monitoring.system
        self._stores_enabled = bool(enabled and tracking.enabled)

        now = time.time()
        self.state = RunState(
            run_id=self.run_id,
            experiment=self.experiment,
            status="starting",
            pid=os.getpid(),
            host=socket.gethostname(),
            started_at=now,
            heartbeat=now,
            total_steps=self.total_steps,
            tokens_total=self.total_steps * self.tokens_per_step,
            output_dir=str(self.output_dir),
            config_path=None if config_path is None else str(config_path),
            model_params=model_params,
        )
        self._elapsed_before = 0.0
        if run_id:  # resuming this run id: keep what its earlier process recorded (start() trims it)
            try:
                previous = read_state(self.output_dir)
            except Exception:
                previous = None
            if previous and previous.get("run_id") == self.run_id:
                self.state.carry_over(previous, None)
                prev_elapsed = _num(previous.get("elapsed_s"))
                self._elapsed_before = prev_elapsed if prev_elapsed and math.isfinite(prev_elapsed) else 0.0
        self._sinks: list[_Sink] = []
        if self._stores_enabled:
            import sqlite_utils  # noqa: F401  (~0.5 s: paid here, before training, not inside a step)

            self._sinks = [
                _Sink("local", local_db_path(self.output_dir), busy_timeout_s),
                _Sink("global", global_db_path(Path(apr_home) if apr_home is not None else None), busy_timeout_s),
            ]
        self._sink_configs = list(config.monitoring.sinks)  # external trackers, opened by start()
        self._trackers: list[SinkWorker] = []  # each on its own thread (apr/track/trackers.py)
        self._plan = plan
        self._apr_home = None if apr_home is None else Path(apr_home)
        self._warnings: list[str] = []
        self._unprinted: list[str] = []  # warnings not printed yet (see _warn)
        self._state_warned = False
        self._finished = False
        self._started = False

        # Session bookkeeping (for elapsed/ETA) and the outbox the worker drains.
        self._session_t0 = now
        self._session_step0: int | None = None
        self._last_log_time: float | None = None
        self._last_sync = 0.0
        self._last_gpu = 0.0
        self._resume_step: int | None = None
        self._out_metrics: list[tuple] = []
        self._out_status: list[tuple] = [(self.run_id, "starting", None, now)]
        self._out_alerts: list[tuple] = []
        self._out_events: list[tuple] = []
        self._out_row_losses: list[tuple] = []  # apr runs blame: written to the local store only
        self._rewind: int | None = None  # a rollback's step, applied to the stores before newer rows
        self._out_artifacts: list[tuple] = []  # (path, kind, step, time) hashed by the worker

        # Worker thread: state-file writes (coalesced) and store batches.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._state_dirty = True
        self._state_fsync = True
        self._db_due = False
        self._db_force = False
        self._requested = 0
        self._done = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._worker_running = background
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"apr-recorder-{self.run_id}", daemon=True)
            self._thread.start()
        self._atexit = _atexit_hook(self)
        atexit.register(self._atexit)
        self._request(state=True, fsync=True)

    # ------------------------------------------------------------------------- public facade

    @property
    def warnings(self) -> list[str]:
        with self._lock:
            return list(self._warnings)

    def start(self, resume_step: int | None = None) -> None:
        """Mark the run running and register it (with its params) in both stores.

        ``resume_step``: the step of the checkpoint a resumed run continues from; the state file's
        histories of the same run id are kept up to it and the stores drop metrics recorded after it.
        """
        self._print_warnings()
        now = time.time()
        with self._lock:
            if resume_step is not None:
                self._resume_step = int(resume_step)
                for history in self.state.histories.values():
                    history.truncate_after(self._resume_step)
                self.state.drop_events_after(self._resume_step, self._events_after)
                self.state["step"] = self._resume_step
                self.state["tokens_seen"] = self._resume_step * self.tokens_per_step
                self._restore_latest_values()
            self._session_t0 = now
            self._session_step0 = self.state["step"]
            self._started = True
            self.state["status"] = "running"
            self.state["status_reason"] = None
            self.state["heartbeat"] = now
            self._out_status.append((self.run_id, "running", None, now))
        self._open_trackers()
        self._request(state=True, fsync=True, db=True)

    def _open_trackers(self) -> None:
        """Start the monitoring.sinks trackers, each on its own thread (apr/track/trackers.py): it is
        opened there and gets the run's params first; one that cannot open is a warning."""
        if not self._sink_configs or self._trackers:
            return
        refused = {key.split("]", 1)[0]: message for key, message, _, _ in sink_target_problems(
            self.config, apr_home=self._apr_home, stores=[s.path for s in self._sinks])}
        params = self._tracker_params()
        for i, cfg in enumerate(self._sink_configs):
            problem = refused.get(f"monitoring.sinks[{i}")  # validate and plan refuse it; checked again here

            def open_tracker(cfg=cfg, problem=problem):
                if problem is not None:
                    raise ValueError(problem)
                return open_sink(cfg, self.output_dir, self.experiment, self.run_id, self._resume_step)

            worker = SinkWorker(str(cfg.type), open_tracker, self._sink_warning, params=params,
                                limits=stall_limits(cfg, self.output_dir))
            with self._lock:
                self._trackers.append(worker)

    def _tracker_params(self) -> dict:
        """What the trackers get as params: the resolved config, the plan's key facts (the plan this
        run was applied from: ``plan`` or the run folder's plan.json of the same config hash) and
        the run's own figures."""
        plan = self._plan
        if plan is None:
            try:
                plan = load_json(self.output_dir / "plan.json", "plan", "plan file")
            except (AprError, OSError):
                plan = None
            if not isinstance(plan, dict) or plan.get("config_hash") != self.config_hash:
                plan = None
        return run_params(self.config.model_dump(mode="json"), plan, {
            "id": self.run_id, "experiment": self.experiment, "total_steps": self.total_steps,
            "tokens_per_step": self.tokens_per_step, "model_params": self.state["model_params"],
            "config_hash": self.config_hash, "resumed_from_step": self._resume_step})

    def _restore_latest_values(self) -> None:
        """A resumed run shows its last recorded values (up to its checkpoint) until it logs new ones."""
        st = self.state
        for key, history in st.histories.items():
            points = history.points()
            if points:
                st[key] = points[-1][1]
        if st["val_loss"] is not None:
            st["val_ppl"] = math.exp(st["val_loss"]) if st["val_loss"] < 700 else None

    def log_step(self, step: int, metrics: dict) -> None:
        """Record one logged optimizer step: state fields, histories, metric rows, heartbeat."""
        self._print_warnings()
        now = time.time()
        step = int(step)
        with self._lock:
            st = self.state
            for key, value in metrics.items():
                if isinstance(value, (list, tuple)):  # per-block norms: one row per block, key.<index>
                    for i, item in enumerate(value):
                        v = _num(item)
                        self._out_metrics.append((self.run_id, step, f"{key}.{i}", v if v == v else None, now))
                    continue
                v = _num(value)
                if v is None or key == "step":  # the step is the row's own column
                    continue
                self._out_metrics.append((self.run_id, step, str(key), v if v == v else None, now))
                if key in STATE_KEYS:
                    st[key] = v
            block = {k: metrics[k] for k in BLOCK_NORM_KEYS if k in metrics}
            if block:
                st["block_norms"] = {"step": step, **block}
            moe = {k: metrics[k] for k in MOE_KEYS if k in metrics}
            if moe:
                st["moe"] = {"step": step, **moe}
            tokens = _finite_or_none(_num(metrics.get("tokens_seen")))
            st["tokens_seen"] = int(tokens) if tokens is not None else step * self.tokens_per_step
            st["step"] = step
            hist = st.histories
            hist["loss"].add(step, metrics.get("loss"))
            hist["lr"].add(step, metrics.get("lr"))
            hist["grad_norm"].add(step, metrics.get("grad_norm"))
            hist["tokens_per_s"].add(step, metrics.get("tokens_per_s"))
            if self._last_log_time is not None:
                gap = now - self._last_log_time
                prev = st["log_period_s"]
                st["log_period_s"] = gap if prev is None else 0.8 * prev + 0.2 * gap
            self._last_log_time = now
            self._update_clock(now)
            if st["cost"] is not None:  # the live cost as a metric too: `apr runs show` reads the stores
                self._out_metrics.append((self.run_id, step, "cost", st["cost"]["spent"], now))
            due = now - self._last_sync >= self.flush_interval_s or len(self._out_metrics) >= FLUSH_ROWS
        self._request(state=True, db=due)

    def log_eval(self, step: int, val_loss: float) -> None:
        """Record a validation result: val_loss and val_ppl = exp(val_loss)."""
        self._print_warnings()
        now = time.time()
        step = int(step)
        v = _num(val_loss)
        ppl = None
        if v is not None and math.isfinite(v):
            ppl = math.exp(v) if v < 700 else math.inf
        with self._lock:
            st = self.state
            st["val_loss"] = _finite_or_none(v)
            st["val_ppl"] = _finite_or_none(ppl)
            st.histories["val_loss"].add(step, v)
            self._out_metrics.append((self.run_id, step, "val_loss", v if v is not None and v == v else None, now))
            if ppl is not None:
                self._out_metrics.append((self.run_id, step, "val_ppl", ppl, now))
            self._update_clock(now)
        self._request(state=True, db=True)

    def log_task_evals(self, step: int, result: dict) -> None:
        """Record an in-training evaluation (apr.evaluate.during_training): metric rows
        ``eval.<task>.acc`` / ``acc_norm``, and the state's ``evals`` (latest score per task) and
        ``samples`` (the latest sample generations)."""
        self._print_warnings()
        now = time.time()
        step = int(step)
        with self._lock:
            for key, value in result.get("metrics", {}).items():
                v = _num(value)
                if v is not None:
                    self._out_metrics.append((self.run_id, step, str(key), v, now))
            evals = dict(self.state.fields.get("evals") or {})
            for name, score in result.get("tasks", {}).items():
                evals[name] = {"step": step, **score}
            self.state["evals"] = evals
            if result.get("samples"):
                self.state["samples"] = {"step": step, "items": result["samples"]}
            if result.get("tasks"):  # the evals panel's bars: each evaluation's scores, with its stage
                history = [e for e in self.state.fields.get("eval_history") or () if e.get("step", 0) < step]
                history.append({"step": step, "stage": result.get("stage"),
                                "scores": {name: score.get("acc") for name, score in result["tasks"].items()}})
                self.state["eval_history"] = history[-EVAL_HISTORY:]
            self._update_clock(now)
        self._request(state=True, db=True)

    def checkpoint(self, step: int, path: Path, is_best: bool = False) -> None:
        """Record a written checkpoint: the state's last_checkpoint and an artifact row (size, sha256)."""
        self._print_warnings()
        now = time.time()
        path = Path(path).resolve()
        with self._lock:
            self.state["last_checkpoint"] = {"step": int(step), "path": str(path), "time": now, "best": bool(is_best)}
            self._out_artifacts.append((path, "checkpoint_best" if is_best else "checkpoint", int(step), now))
            self._update_clock(now)
        self._request(state=True, fsync=True, db=True)

    def log_event(self, kind: str, step: int, message: str, detail: dict | None = None) -> None:
        """Record a run event (``bad_step``, ``rollback``): the state's ``events`` and both stores'
        ``events`` table, ``detail`` as JSON (a rollback's rows skipped: the bad-batch ledger)."""
        self._print_warnings()
        now = time.time()
        entry = {"step": int(step), "time": now, "kind": kind, "message": message, "detail": detail}
        with self._lock:
            self.state.add_event(entry)
            self._out_events.append((self.run_id, int(step), now, kind, message,
                                     json.dumps(detail, allow_nan=False, default=str) if detail is not None else None))
            self._update_clock(now)
        self._request(state=True, fsync=True, db=True)

    def log_drift(self, step: int, drift: dict) -> None:
        """The plan-against-actual comparison (apr/train/drift.py): the state's ``drift`` and its
        ``drift_*`` figures as metric rows."""
        self._print_warnings()
        now = time.time()
        with self._lock:
            self.state["drift"] = dict(drift)
            for key in ("drift_step_time", "drift_tokens_per_s", "drift_memory"):
                value = _num(drift.get(key))
                if value is not None:
                    self._out_metrics.append((self.run_id, int(step), key, value, now))
            self._update_clock(now)
        self._request(state=True, db=True)

    def log_data_drift(self, step: int, figures: dict) -> None:
        """Data drift during training (apr/train/datadrift.py): the state's ``data_drift`` and its
        ``data_drift_*`` figures as metric rows."""
        self._print_warnings()
        now = time.time()
        with self._lock:
            self.state["data_drift"] = dict(figures)
            for key, value in figures.items():
                v = _num(value)
                if key.startswith("data_drift_") and v is not None:
                    self._out_metrics.append((self.run_id, int(step), key, v, now))
            self._update_clock(now)
        self._request(state=True, db=True)

    def log_histograms(self, step: int, histograms: dict) -> None:
        """Per-layer weight and gradient histograms (apr/train/histograms.py): the latest in the
        state's ``histograms``, each in both stores' events as kind ``histograms`` (read back by
        ``store.histograms``, left out of ``store.events``)."""
        self._print_warnings()
        now = time.time()
        record = {"step": int(step), **histograms}
        with self._lock:
            self.state["histograms"] = record
            self._out_events.append((self.run_id, int(step), now, HISTOGRAMS_EVENT,
                                     f"{len(histograms.get('layers') or ())} layers",
                                     json.dumps(record, allow_nan=False, default=str)))
            self._update_clock(now)
        self._request(state=True, db=True)

    def log_row_losses(self, step: int, rows: list[dict]) -> None:
        """Each training row's loss at a logged step (apr/train/blame.py), for ``apr runs blame``: the
        local store's ``row_losses`` table only (the registry stays small); nothing in the state file."""
        with self._lock:
            self._out_row_losses.extend(
                (self.run_id, int(step), r.get("micro_batch"), r.get("index"), r.get("source"), r.get("shard"),
                 r.get("row"), _num(r.get("loss"))) for r in rows)
        self._request(db=True)

    def log_mixture(self, step: int, mixture: dict) -> None:
        """A data mixture's progress (apr/data/mixloader.py ``figures``): the state's ``mixture``
        (stage, and per source tokens, rows, epochs and the last val loss) and metric rows
        ``tokens/<source>`` and ``val_loss/<source>``."""
        self._print_warnings()
        now = time.time()
        with self._lock:
            self.state["mixture"] = {"step": int(step), **mixture}
            for name, figures in (mixture.get("sources") or {}).items():
                for key, metric in (("tokens", f"tokens/{name}"), ("val_loss", f"val_loss/{name}")):
                    value = _num(figures.get(key))
                    if value is not None:
                        self._out_metrics.append((self.run_id, int(step), metric, value, now))
            self._update_clock(now)
        self._request(state=True, db=True)

    def events_mark(self) -> float | None:
        """The time of the newest event recorded, 0.0 before the first (a checkpoint's metadata: a
        resume from it drops the events recorded later, which its steps and decisions record again)."""
        with self._lock:
            return max((e["time"] for e in self.state["events"] if isinstance(e.get("time"), (int, float))),
                       default=0.0)

    def recorded_events(self) -> list[dict]:
        """The events this run has recorded so far (the state file's, carried over on a resume)."""
        with self._lock:
            return list(self.state["events"])

    def rewind(self, step: int) -> None:
        """A rollback to the checkpoint at ``step``: the steps after it will be trained again, so
        their recorded metrics (state histories, both stores) are dropped, as a resume does."""
        step = int(step)
        with self._lock:
            for history in self.state.histories.values():
                history.truncate_after(step)
            self.state.drop_events_after(step)
            self._out_metrics = [m for m in self._out_metrics if m[1] <= step]
            self._out_events = [e for e in self._out_events if not (e[3] == "bad_step" and e[1] > step)]
            self._out_row_losses = [r for r in self._out_row_losses if r[1] <= step]
            self._rewind = step if self._rewind is None else min(self._rewind, step)
            self.state["step"] = step
            self.state["tokens_seen"] = step * self.tokens_per_step
            self._restore_latest_values()
        self._request(state=True, db=True)

    def check_alerts(self, metrics: dict) -> list[Alert]:
        """Evaluate `monitoring.alerts` on this step's metrics; record and return the ones that fire."""
        self._print_warnings()
        if not len(self._alerts):
            return []
        with self._lock:
            values = {
                "step": self.state["step"],
                "val_loss": self.state["val_loss"],
                "epoch": self.state["epoch"],
            }
            evals = self.state.fields.get("evals")
            if evals:  # in-training task scores: eval.<task>.acc in a condition
                values["eval"] = {name: {k: v for k, v in score.items() if k in ("acc", "acc_norm")}
                                  for name, score in evals.items()}
        values.update({k: v for k, v in metrics.items() if v is not None})
        step = values.get("step")
        fired = self._alerts.check(values, step=int(step) if _num(step) is not None else None)
        for err in self._alerts.errors:
            self._warn(f"alert {err}")  # once each: _warn ignores repeats
        if not fired:
            return fired
        with self._lock:
            for alert in fired:
                self.state.add_alert(alert.to_dict())
                self._out_alerts.append(
                    (self.run_id, alert.step, alert.time, alert.condition, alert.action, alert.message, alert.severity)
                )
        self._request(state=True, fsync=True, db=True)
        return fired

    def finish(self, status: str, reason: str | None = None) -> None:
        """Record the end: final status and reason, flush every pending row, write the final state."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"finish status must be one of {FINAL_STATUSES}, got {status!r}")
        if self._finished:
            return
        now = time.time()
        with self._lock:
            self._finished = True
            st = self.state
            st["status"] = status
            st["status_reason"] = reason
            st["ended_at"] = now
            self._update_clock(now)
            st["eta_s"] = 0.0 if status == "finished" else None
            self._out_status.append((self.run_id, status, reason, now))
            self._state_dirty = self._state_fsync = self._db_force = True
        self.flush()
        if self._trackers:  # the last rows are queued: a bounded wait for every tracker to take them
            with self._lock:
                workers, self._trackers = self._trackers, []
            warned = len(self._warnings)
            close_workers(workers, status)
            if len(self._warnings) > warned:  # a tracker that failed or hung at the end: in the state file too
                self.flush()
        if self._thread is not None:
            with self._cv:
                self._stopping = True
                self._cv.notify_all()
            self._thread.join(timeout=5.0)
        self._print_warnings()
        for sink in self._sinks:
            sink.close()
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass

    def flush(self, timeout: float | None = 120.0) -> None:
        """Block until every queued state write and store batch has been attempted."""
        with self._cv:
            self._db_due = True
            self._requested += 1
            target = self._requested
            running = self._worker_running
            if running:
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._done >= target, timeout=timeout)
        if not running:
            self._work()
        self._print_warnings()

    # ----------------------------------------------------------------------------- internals

    def _update_clock(self, now: float) -> None:
        """heartbeat, elapsed_s and eta_s (from this process's own step rate). Caller holds the lock."""
        st = self.state
        st["heartbeat"] = now
        st["elapsed_s"] = self._elapsed_before + (now - self._session_t0)
        step0 = self._session_step0
        done = st["step"] - step0 if step0 is not None else 0
        if done > 0 and self.total_steps:
            rate = done / max(now - self._session_t0, 1e-9)
            st["eta_s"] = max(self.total_steps - st["step"], 0) / rate
        else:
            st["eta_s"] = None
        st["cost"] = run_cost(self.config.training, st["elapsed_s"], st["eta_s"])

    def _warn(self, message: str, print_now: bool = True) -> None:
        """Record a warning once: stderr, `warnings`, and the state file's `store_warnings`.

        Only the trainer's thread prints (a warning found by the writer thread or a tracker's
        thread waits for the trainer's next call into the recorder), one whole line per write, so
        warnings never land in the middle of the trainer's own console lines."""
        with self._lock:
            if message in self._warnings:
                return
            self._warnings.append(message)
            self._unprinted.append(message)
            self.state["store_warnings"] = list(self._warnings)
            self._state_dirty = True
        if print_now and threading.current_thread() is not self._thread:
            self._print_warnings()

    def _sink_warning(self, message: str) -> None:
        """A tracker's warning (from its own thread, or the writer's): recorded now, printed by the
        trainer's next call into the recorder, written with the next state file."""
        self._warn(message, print_now=threading.current_thread() is threading.main_thread())

    def _print_warnings(self) -> None:
        if not self._unprinted:  # the common case, without the lock
            return
        with self._lock:
            lines, self._unprinted = self._unprinted, []
        for message in lines:
            sys.stderr.write(f"apr: warning: {message}\n")
        sys.stderr.flush()

    def _request(self, state: bool = False, fsync: bool = False, db: bool = False, force: bool = False) -> None:
        with self._cv:
            self._state_dirty |= state
            self._state_fsync |= fsync
            self._db_due |= db
            self._db_force |= force
            self._requested += 1
            running = self._worker_running
            if running:
                self._cv.notify_all()
        if not running:
            self._work()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._requested > self._done or self._stopping)
                    if self._requested == self._done:  # stopping, and nothing left to do
                        return
                    stopping = self._stopping
                if not stopping:
                    # Let the training thread finish its bookkeeping and get back into torch (which
                    # releases the GIL) before this thread takes the GIL to render the state.
                    time.sleep(COALESCE_S)
                with self._cv:
                    target = self._requested
                try:
                    self._work()
                except Exception as e:  # never let the recorder thread die silently
                    self._warn(f"recorder: {type(e).__name__}: {e}")
                with self._cv:
                    self._done = max(self._done, target)
                    self._cv.notify_all()
        finally:
            with self._cv:
                self._worker_running = False
                self._done = self._requested  # release any flush() waiting on a thread that is gone
                self._cv.notify_all()

    def _work(self) -> None:
        """One pass: store batches (if due), GPU sample (if due), then the state file (if dirty)."""
        now = time.time()
        with self._lock:
            db_due, force = self._db_due, self._db_force
            self._db_due = self._db_force = False
            if db_due:
                metrics, self._out_metrics = self._out_metrics, []
                status, self._out_status = self._out_status, []
                alerts, self._out_alerts = self._out_alerts, []
                events, self._out_events = self._out_events, []
                row_losses, self._out_row_losses = self._out_row_losses, []
                rewind, self._rewind = self._rewind, None
                artifact_reqs, self._out_artifacts = self._out_artifacts, []
                run = self._run_row()
                self._last_sync = now
        if db_due and self._sinks:
            artifacts = []
            for path, kind, step, t in artifact_reqs:
                artifacts.extend(_checkpoint_artifacts(self.run_id, path, kind, step, t))
            register = {"params": self._params(), "resume_step": self._resume_step,
                        "events_after": self._events_after if self._resume_step is not None else None}
            for sink in self._sinks:
                sink.add(metrics, status, alerts, artifacts, events, rewind,
                         row_losses if sink.label == "local" else ())
                warning = sink.sync(run, register, force, now)
                if warning:
                    self._warn(warning)
        if db_due and self._trackers:
            self._feed_trackers(metrics)
        if self._system.enabled and now - self._last_gpu >= self._system.interval / 1000.0:
            self._last_gpu = now

            snap = _only_metrics(gpu_snapshot(), self._system.metrics)
            with self._lock:
                self.state["gpu"] = snap
        with self._lock:
            if not self._state_dirty:
                return
            data = self.state.to_json_bytes()
            fsync = self._state_fsync
            self._state_dirty = self._state_fsync = False
        self._write_state(data, fsync)

    def _feed_trackers(self, metrics: list) -> None:
        """The metric rows to each tracker's queue (never waits on a tracker; one that failed takes none)."""
        with self._lock:
            workers = list(self._trackers)
        for worker in workers:
            worker.submit(metrics)

    def _write_state(self, data: bytes, fsync: bool) -> None:
        try:
            try:
                atomic_write_bytes(self.output_dir / STATE_FILE, data, fsync=fsync)
            except FileNotFoundError:  # the run folder is not there (yet, or any more): make it, once
                self.output_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.output_dir / STATE_FILE, data, fsync=fsync)
        except OSError as e:
            if not self._state_warned:
                self._state_warned = True
                self._warn(f"cannot write {self.output_dir / STATE_FILE}: {e}; training continues")

    def _run_row(self) -> dict:
        st = self.state
        return {
            "id": self.run_id,
            "experiment": self.experiment,
            "status": st["status"],
            "status_reason": st["status_reason"],
            "config_hash": self.config_hash,
            "started": st["started_at"],
            "ended": st["ended_at"],
            "heartbeat": st["heartbeat"],
            "log_period_s": st["log_period_s"],
            "host": st["host"],
            "pid": st["pid"],
            "output_dir": st["output_dir"],
            "config_path": st["config_path"],
            "step": st["step"],
            "total_steps": st["total_steps"],
            "last_loss": _finite_or_none(st["loss"]),
            "last_val_loss": _finite_or_none(st["val_loss"]),
            "tokens_seen": st["tokens_seen"],
            "model_params": st["model_params"],
        }

    def _params(self) -> dict:
        params = flatten_params(self.config.model_dump(mode="json"))
        params.update(
            flatten_params(
                {
                    "total_steps": self.total_steps,
                    "tokens_per_step": self.tokens_per_step,
                    "model_params": self.state["model_params"],
                    "config_hash": self.config_hash,
                },
                "run",
            )
        )
        return params


def _atexit_hook(recorder: RunRecorder):
    """An exit hook that records a run the trainer never finished as failed (weakly referenced)."""
    ref = weakref.ref(recorder)

    def hook() -> None:
        rec = ref()
        if rec is not None and not rec._finished:
            try:
                rec.finish("failed", "the process exited without recording the end of the run")
            except Exception:
                pass

    return hook
