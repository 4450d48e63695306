"""The experiment stores: `<output_dir>/.apr/experiments.db` (local) and `$APR_HOME/experiments.db`
(the global registry). Both are SQLite in WAL mode with a busy timeout and the same, versioned schema.

Writing goes through `StoreWriter` (sqlite-utils; one connection per thread, one transaction per
batch). Reading goes through the plain-`sqlite3` functions at the bottom, so `apr runs ls` does not
pay for importing sqlite-utils. All SQL is parameterised; table and column names are constants.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.errors import AprError, Finding
from apr.readers import InputError, check_regular
from apr.severity import severity_of

SCHEMA_VERSION = 5
HISTOGRAMS_EVENT = "histograms"  # the events kind of per-layer histograms (recorder.log_histograms)
BUSY_TIMEOUT_S = 5.0

RUN_COLUMNS: dict[str, type] = {
    "id": str,
    "experiment": str,
    "status": str,
    "status_reason": str,
    "config_hash": str,
    "started": float,
    "ended": float,
    "heartbeat": float,
    "log_period_s": float,
    "host": str,
    "pid": int,
    "output_dir": str,
    "config_path": str,
    "step": int,
    "total_steps": int,
    "last_loss": float,
    "last_val_loss": float,
    "tokens_seen": int,
    "model_params": int,
}


class StoreError(AprError):
    """A store cannot be opened or read (not an apr store, written by a newer apr, corrupt)."""


def _store_error(path: Path | str, message: str, code: str = "track.store_error") -> StoreError:
    return StoreError(f"{path}: {message}", [Finding("error", code, message, file=str(path))])


# ---------------------------------------------------------------------------------- migrations


def _migration_1(db) -> None:
    """The first schema: experiments, runs, params, metrics, artifacts, status history, alerts."""
    db["experiments"].create({"name": str, "created": float}, pk="name", not_null=["created"])
    db["runs"].create(
        RUN_COLUMNS,
        pk="id",
        not_null=["experiment", "status"],
        foreign_keys=[("experiment", "experiments", "name")],
    )
    db["runs"].create_index(["started"], index_name="runs_started")
    db["runs"].create_index(["experiment", "started"], index_name="runs_experiment_started")
    db["runs"].create_index(["status"], index_name="runs_status")
    # `value` is declared BLOB, which in SQLite means "no affinity": each param keeps its own type.
    db["params"].create(
        {"run_id": str, "key": str, "value": "BLOB", "type": str},
        pk=("run_id", "key"),
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["metrics"].create(
        {"run_id": str, "step": int, "key": str, "value": float, "time": float},
        not_null=["run_id", "step", "key", "time"],
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["metrics"].create_index(["run_id", "key", "step"], index_name="metrics_run_key_step")
    db["artifacts"].create(
        {"run_id": str, "path": str, "kind": str, "size": int, "sha256": str, "step": int, "time": float},
        pk=("run_id", "path"),
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["status_history"].create(
        {"run_id": str, "status": str, "reason": str, "time": float},
        not_null=["run_id", "status", "time"],
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["status_history"].create_index(["run_id", "time"], index_name="status_history_run_time")
    db["alerts"].create(
        {"run_id": str, "step": int, "time": float, "condition": str, "action": str, "message": str},
        not_null=["run_id", "time", "condition", "action"],
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["alerts"].create_index(["run_id", "time"], index_name="alerts_run_time")


def _migration_2(db) -> None:
    """Run events: skipped bad steps and rollbacks (with the rows they skipped: the bad-batch ledger)."""
    db["events"].create(
        {"run_id": str, "step": int, "time": float, "kind": str, "message": str, "detail": str},
        not_null=["run_id", "time", "kind"],
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["events"].create_index(["run_id", "time"], index_name="events_run_time")


def _migration_3(db) -> None:
    """Probe results (`apr train plan --probe`): the calibration store (apr/track/calibration.py)."""
    db["calibrations"].create(
        {"id": int, "time": float, "device": str, "device_name": str, "torch": str, "cuda": str, "apr": str,
         "shape_key": str, "shape": str, "result": str},
        pk="id", not_null=["time", "device", "shape_key", "result"],
    )
    db["calibrations"].create_index(["device", "device_name", "shape_key"], index_name="calibrations_lookup")


def _migration_4(db) -> None:
    """Alert severities (critical, error, warning, info; apr/severity.py). Rows of older runs keep
    NULL and are read by their action."""
    db.conn.execute("ALTER TABLE alerts ADD COLUMN severity TEXT")


def _migration_5(db) -> None:
    """Each training row's loss at each logged step (``apr runs blame``; the local store only)."""
    db["row_losses"].create(
        {"run_id": str, "step": int, "micro_batch": int, "data_index": int, "source": str, "shard": str, "row": int,
         "loss": float},
        not_null=["run_id", "step"],
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["row_losses"].create_index(["run_id", "step"], index_name="row_losses_run_step")


# version -> function bringing a store from version-1 to version. Never edit a shipped migration.
MIGRATIONS = {1: _migration_1, 2: _migration_2, 3: _migration_3, 4: _migration_4, 5: _migration_5}


def _read_version(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
    if row is None:
        return 0
    value = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
    return int(value or 0)


def migrate(db, path: Path | str = "") -> int:
    """Bring the store up to SCHEMA_VERSION in one IMMEDIATE transaction (safe against a
    concurrent migrator). Returns the version. Raises StoreError for a store from a newer apr."""
    conn = db.conn
    if _read_version(conn) == SCHEMA_VERSION:
        return SCHEMA_VERSION
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied REAL NOT NULL)")
        current = _read_version(conn)
        if current > SCHEMA_VERSION:
            raise _store_error(
                path,
                f"store schema version {current} is newer than this apr supports ({SCHEMA_VERSION}); upgrade apr",
                "track.store_version",
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[version](db)
            conn.execute("INSERT INTO schema_version (version, applied) VALUES (?, ?)", (version, time.time()))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return SCHEMA_VERSION


# ------------------------------------------------------------------------------------- writing


def flatten_params(doc: Any, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Flatten a nested config dict to ``{"a.b.c": (value, type)}``; lists are stored as JSON text."""
    out: dict[str, tuple[Any, str]] = {}
    if isinstance(doc, dict):
        for key, value in doc.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value:
                out.update(flatten_params(value, name))
            else:
                out[name] = _typed(value)
    else:
        out[prefix or "value"] = _typed(doc)
    return out


def _typed(value: Any) -> tuple[Any, str]:
    if value is None:
        return None, "null"
    if isinstance(value, bool):
        return int(value), "bool"
    if isinstance(value, int):  # SQLite integers are 64-bit: a larger one (a seed of 2**64) is kept as text
        return (value if -2**63 <= value < 2**63 else str(value)), "int"
    if isinstance(value, float):
        return (value if math.isfinite(value) else str(value)), "float"
    if isinstance(value, str):
        return value, "str"
    return json.dumps(value, sort_keys=True, default=str), "json"


def untyped(value: Any, kind: str) -> Any:
    """Inverse of the stored (value, type) pair."""
    if kind == "bool":
        return bool(value)
    if kind == "json" and isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    if kind == "float" and isinstance(value, str):
        return float(value)
    if kind == "int" and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    return value


def _drop_bad_steps_after(conn: sqlite3.Connection, run_id: str, step: int) -> None:
    """The steps after ``step`` are trained again: their bad_step events, histograms and row losses go
    (rollbacks stay)."""
    conn.execute("DELETE FROM events WHERE run_id = ? AND kind IN ('bad_step', ?) AND step > ?",
                 (run_id, HISTOGRAMS_EVENT, step))
    conn.execute("DELETE FROM row_losses WHERE run_id = ? AND step > ?", (run_id, step))


@dataclass
class Batch:
    """Everything one sync writes to one store, in one transaction."""

    run: dict[str, Any]  # the runs row, upserted (id, status, step, heartbeat, ...)
    register: dict | None = None  # {"params": {...}, "resume_step": int|None} on a run's first write
    metrics: list[tuple] = field(default_factory=list)  # (run_id, step, key, value, time)
    status: list[tuple] = field(default_factory=list)  # (run_id, status, reason, time)
    artifacts: list[dict] = field(default_factory=list)
    alerts: list[tuple] = field(default_factory=list)  # (run_id, step, time, condition, action, message, severity)
    events: list[tuple] = field(default_factory=list)  # (run_id, step, time, kind, message, detail JSON)
    # (run_id, step, micro_batch, data_index, source, shard, row, loss): apr runs blame
    row_losses: list[tuple] = field(default_factory=list)
    rewind: int | None = None  # a rollback: drop this run's metric rows after this step, before the new ones


class StoreWriter:
    """One store opened for writing, from one thread. Raises on any failure; callers decide."""

    def __init__(self, path: Path, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.db = None

    def open(self) -> None:
        import sqlite_utils

        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            db = sqlite_utils.Database(conn)
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.enable_wal()
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable at checkpoints, never corrupt
            migrate(db, self.path)
        except BaseException:
            conn.close()
            raise
        self.db = db

    def write(self, batch: Batch) -> None:
        if self.db is None:
            self.open()
        db = self.db
        conn = db.conn
        run = {k: v for k, v in batch.run.items() if k in RUN_COLUMNS}
        conn.execute("BEGIN IMMEDIATE")
        try:
            if batch.register is not None:
                conn.execute(
                    "INSERT OR IGNORE INTO experiments (name, created) VALUES (?, ?)",
                    (run["experiment"], time.time()),
                )
                db["runs"].upsert(run, pk="id")
                conn.execute("DELETE FROM params WHERE run_id = ?", (run["id"],))
                db["params"].insert_all(
                    (
                        {"run_id": run["id"], "key": k, "value": v, "type": t}
                        for k, (v, t) in batch.register.get("params", {}).items()
                    ),
                    batch_size=200,
                )
                resume_step = batch.register.get("resume_step")
                if resume_step is not None:  # a resumed run replays the steps after its checkpoint
                    conn.execute("DELETE FROM metrics WHERE run_id = ? AND step > ?", (run["id"], resume_step))
                    _drop_bad_steps_after(conn, run["id"], resume_step)
                    if (after := batch.register.get("events_after")) is not None:  # recorded again (state.py)
                        conn.execute("DELETE FROM events WHERE run_id = ? AND time > ? AND kind NOT IN "
                                     "(?, 'steer_rejected')", (run["id"], after, HISTOGRAMS_EVENT))
            else:
                db["runs"].upsert(run, pk="id")
            if batch.rewind is not None:
                conn.execute("DELETE FROM metrics WHERE run_id = ? AND step > ?", (run["id"], batch.rewind))
                _drop_bad_steps_after(conn, run["id"], batch.rewind)
            if batch.metrics:
                conn.executemany(
                    "INSERT INTO metrics (run_id, step, key, value, time) VALUES (?, ?, ?, ?, ?)", batch.metrics
                )
            if batch.status:
                conn.executemany(
                    "INSERT INTO status_history (run_id, status, reason, time) VALUES (?, ?, ?, ?)", batch.status
                )
            if batch.alerts:
                conn.executemany(
                    "INSERT INTO alerts (run_id, step, time, condition, action, message, severity) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    batch.alerts,
                )
            if batch.events:
                conn.executemany(
                    "INSERT INTO events (run_id, step, time, kind, message, detail) VALUES (?, ?, ?, ?, ?, ?)",
                    batch.events,
                )
            if batch.row_losses:
                conn.executemany(
                    "INSERT INTO row_losses (run_id, step, micro_batch, data_index, source, shard, row, loss) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    batch.row_losses,
                )
            for artifact in batch.artifacts:
                db["artifacts"].upsert(artifact, pk=("run_id", "path"))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        if self.db is not None:
            try:
                self.db.conn.close()
            finally:
                self.db = None


# ------------------------------------------------------------------------------------- reading


def _connect_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection that works even where the folder is not writable."""
    uri = path.resolve().as_uri()
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        return conn
    except sqlite3.Error:
        # A WAL store in a folder we cannot write (no -shm can be made): read the file as it stands.
        return sqlite3.connect(f"{uri}?immutable=1", uri=True)


def connect_readonly(path: Path | str) -> sqlite3.Connection:
    """Open a store for reading without creating or migrating anything. Raises StoreError."""
    path = Path(path)
    if not path.is_file():
        if os.path.lexists(path):  # never opened: sqlite would block on a FIFO

            try:
                check_regular(path, "experiment store")
            except InputError as err:
                raise _store_error(path, f"not an experiment store: {err.findings[0].got}",
                                   "track.store_invalid") from None
        raise _store_error(path, "no such experiment store", "track.store_missing")
    try:
        conn = _connect_ro(path)
        version = _read_version(conn)
    except sqlite3.Error as e:
        raise _store_error(path, f"cannot read experiment store: {e}") from None
    if version == 0:
        conn.close()
        raise _store_error(path, "not an apr experiment store (no schema_version table)", "track.store_invalid")
    if version > SCHEMA_VERSION:
        conn.close()
        raise _store_error(
            path, f"store schema version {version} is newer than this apr ({SCHEMA_VERSION}); upgrade apr",
            "track.store_version",
        )
    conn.row_factory = sqlite3.Row
    return conn


def query_runs(
    conn: sqlite3.Connection,
    *,
    statuses: tuple[str, ...] | None = None,
    experiment: str | None = None,
    limit: int | None = None,
) -> list[dict]:
    """Rows of the runs table, newest first, filtered by stored status and experiment."""
    sql = "SELECT * FROM runs"
    where, args = [], []
    if statuses:
        where.append("status IN (" + ",".join("?" * len(statuses)) + ")")
        args.extend(statuses)
    if experiment is not None:
        where.append("experiment = ?")
        args.append(experiment)
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY started DESC, id DESC"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    cur = conn.cursor()
    cur.row_factory = None  # plain tuples zipped with the column names: ~2x faster than sqlite3.Row
    cur.execute(sql, args)
    columns = [d[0] for d in cur.description]
    return [dict(zip(columns, r, strict=True)) for r in cur]


def get_run(conn: sqlite3.Connection, run_id: str) -> dict | None:
    row = conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    return dict(row) if row is not None else None


def find_run_ids(conn: sqlite3.Connection, prefix: str) -> list[str]:
    """Run ids equal to ``prefix`` or starting with it (a unique prefix is enough to name a run)."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    rows = conn.execute("SELECT id FROM runs WHERE id = ? OR id LIKE ? ESCAPE '\\'", (prefix, escaped + "%"))
    return [r[0] for r in rows]


def run_params(conn: sqlite3.Connection, run_id: str) -> dict[str, Any]:
    rows = conn.execute("SELECT key, value, type FROM params WHERE run_id = ? ORDER BY key", (run_id,))
    return {r[0]: untyped(r[1], r[2]) for r in rows}


def metric_keys(conn: sqlite3.Connection, run_id: str) -> list[str]:
    rows = conn.execute("SELECT DISTINCT key FROM metrics WHERE run_id = ? ORDER BY key", (run_id,))
    return [r[0] for r in rows]


def final_metrics(conn: sqlite3.Connection, run_id: str) -> dict[str, dict]:
    """The latest value of each metric: ``{key: {"step", "value", "time"}}``."""
    out = {}
    for key in metric_keys(conn, run_id):
        row = conn.execute(
            "SELECT step, value, time FROM metrics WHERE run_id = ? AND key = ? ORDER BY step DESC, time DESC LIMIT 1",
            (run_id, key),
        ).fetchone()
        out[key] = {"step": row[0], "value": row[1], "time": row[2]}
    return out


def metric_series(conn: sqlite3.Connection, run_id: str, key: str) -> list[tuple[int, float | None]]:
    rows = conn.execute(
        "SELECT step, value FROM metrics WHERE run_id = ? AND key = ? ORDER BY step, time", (run_id, key)
    )
    return [(r[0], r[1]) for r in rows]


def metric_rows(conn: sqlite3.Connection, run_id: str) -> list[tuple[int, str, float | None, float]]:
    rows = conn.execute(
        "SELECT step, key, value, time FROM metrics WHERE run_id = ? ORDER BY step, key, time", (run_id,)
    )
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def artifacts(conn: sqlite3.Connection, run_id: str) -> list[dict]:
    rows = conn.execute(
        "SELECT path, kind, size, sha256, step, time FROM artifacts WHERE run_id = ? ORDER BY time, path", (run_id,)
    )
    return [dict(r) for r in rows]


def status_history(conn: sqlite3.Connection, run_id: str) -> list[dict]:
    rows = conn.execute(
        "SELECT status, reason, time FROM status_history WHERE run_id = ? ORDER BY time, rowid", (run_id,)
    )
    return [dict(r) for r in rows]


def alerts(conn: sqlite3.Connection, run_id: str) -> list[dict]:
    """A run's alerts in order; ``severity`` filled in from the action for rows written before
    severities (apr/severity.py)."""
    rows = conn.execute(
        "SELECT step, time, condition, action, message, severity FROM alerts WHERE run_id = ? ORDER BY time, rowid",
        (run_id,),
    )
    return [{**dict(r), "severity": severity_of(r["severity"], r["action"])} for r in rows]


def events(conn: sqlite3.Connection, run_id: str) -> list[dict]:
    """The run's events (bad steps, rollbacks), oldest first, ``detail`` parsed; [] from a store
    written before events existed. Histogram records (``histograms``) are left out."""
    if conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='events'").fetchone() is None:
        return []
    rows = conn.execute(
        "SELECT step, time, kind, message, detail FROM events WHERE run_id = ? AND kind != ? ORDER BY time, rowid",
        (run_id, HISTOGRAMS_EVENT),
    )
    return [{**dict(r), "detail": json.loads(r["detail"]) if r["detail"] else None} for r in rows]


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None


def row_losses(conn: sqlite3.Connection, run_id: str, step: int) -> list[dict]:
    """The recorded rows of one step, highest loss first: ``{"micro_batch", "data_index", "source",
    "shard", "row", "loss"}``; [] from a store older than row losses."""
    if not _has_table(conn, "row_losses"):
        return []
    rows = conn.execute(
        "SELECT micro_batch, data_index, source, shard, row, loss FROM row_losses WHERE run_id = ? AND step = ? "
        "ORDER BY loss IS NULL, loss DESC, micro_batch, data_index", (run_id, int(step)))
    return [dict(r) for r in rows]


def row_losses_of(conn: sqlite3.Connection, run_id: str, micro_batches: list[int]) -> dict[tuple, float]:
    """``{(micro_batch, data_index): loss}`` recorded for these global micro-batches (the ledger's rows)."""
    if not _has_table(conn, "row_losses"):
        return {}
    out: dict[tuple, float] = {}
    for start in range(0, len(micro_batches), 500):  # SQLite's bound-parameter limit
        part = micro_batches[start:start + 500]
        rows = conn.execute(f"SELECT micro_batch, data_index, loss FROM row_losses WHERE run_id = ? AND micro_batch "
                            f"IN ({','.join('?' * len(part))}) ORDER BY step", (run_id, *part))
        out.update({(r[0], r[1]): r[2] for r in rows})
    return out


def row_loss_steps(conn: sqlite3.Connection, run_id: str) -> list[int]:
    """The steps of a run that have row losses, in order."""
    if not _has_table(conn, "row_losses"):
        return []
    return [r[0] for r in conn.execute("SELECT DISTINCT step FROM row_losses WHERE run_id = ? ORDER BY step",
                                       (run_id,))]


def fork_parents(conn: sqlite3.Connection) -> dict[str, dict]:
    """``{run_id: {"run_id", "step"}}``: the parent run and step of every run in the store that
    ``apr train fork`` started (its ``fork`` event); {} from a store without events."""
    if conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='events'").fetchone() is None:
        return {}
    out: dict[str, dict] = {}
    for run_id, detail in conn.execute("SELECT run_id, detail FROM events WHERE kind = 'fork' ORDER BY time, rowid"):
        try:
            parent = (json.loads(detail) if detail else {}).get("parent")
        except (json.JSONDecodeError, AttributeError):
            continue  # a hand-edited row: no lineage rather than no listing
        if isinstance(parent, dict) and run_id not in out:
            out[run_id] = {"run_id": parent.get("run_id"), "step": parent.get("step")}
    return out


def histograms(conn: sqlite3.Connection, run_id: str) -> list[dict]:
    """The run's per-layer histogram records (monitoring.histograms), oldest first: each
    ``{step, bins, layers: [{name, kind, lo, hi, counts, ...}]}``."""
    if conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='events'").fetchone() is None:
        return []
    rows = conn.execute("SELECT detail FROM events WHERE run_id = ? AND kind = ? ORDER BY step, rowid",
                        (run_id, HISTOGRAMS_EVENT))
    return [json.loads(r[0]) for r in rows if r[0]]


def integrity_check(path: Path | str) -> str:
    """``PRAGMA integrity_check`` of a store: "ok" when sound."""
    conn = _connect_ro(Path(path))
    try:
        return "\n".join(str(r[0]) for r in conn.execute("PRAGMA integrity_check"))
    finally:
        conn.close()
