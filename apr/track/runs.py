"""What `apr runs ls` and `apr runs show` report: runs found in the local stores under a folder or
in the global registry, as plain dicts with a stable schema (docs/runs.md). Standard library only,
so listing stays fast.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from apr.errors import AprError, Finding
from apr.severity import count_by_severity
from apr.track import store
from apr.track.liveness import trainer_alive
from apr.track.names import global_db_path, validate_experiment, validate_run_id
from apr.track.state import ACTIVE_STATUSES, STATUSES, is_stale

RUNS_SCHEMA_VERSION = 1
STATUS_FILTERS = (*STATUSES, "stale", "dead")
CHECKPOINT_KINDS = ("checkpoint", "checkpoint_best")  # weights files; "checkpoint_meta" is their JSON
DISCOVERY_DEPTH = 3  # <root>/.apr, <root>/*/.apr, ... down to <root>/*/*/*/.apr
_MAX_DIRS = 20_000  # give up scanning a huge tree rather than hang


@dataclass
class RunListing:
    runs: list[dict]
    stores: list[str]  # the stores that were read
    warnings: list[str] = field(default_factory=list)  # stores that could not be read


TAG_PREFIX = "monitoring.tracking.tags."  # tracking.tags are recorded as params under this prefix


def find_local_stores(root: Path, depth: int = DISCOVERY_DEPTH) -> list[Path]:
    """``.apr/experiments.db`` files in ``root`` and its subfolders down to ``depth`` levels.
    Hidden folders are not entered (except ``.apr`` itself); symlinked folders are not followed."""
    found: list[Path] = []
    frontier = [(Path(root), 0)]
    visited = 0
    while frontier and visited < _MAX_DIRS:
        folder, level = frontier.pop(0)
        visited += 1
        db = folder / ".apr" / "experiments.db"
        if os.path.lexists(db):  # a FIFO or folder there is listed, so that the reader warns about it
            found.append(db)
        if level >= depth:
            continue
        try:
            with os.scandir(folder) as it:
                subdirs = sorted(
                    e.name
                    for e in it
                    if not e.name.startswith(".") and e.name != "__pycache__" and e.is_dir(follow_symlinks=False)
                )
        except OSError:
            continue
        frontier.extend((folder / name, level + 1) for name in subdirs)
    return found


_NUMBER_COLUMNS = ("started", "ended", "heartbeat", "step", "total_steps", "last_loss", "last_val_loss",
                   "tokens_seen", "pid", "model_params")
_TEXT_COLUMNS = ("id", "experiment", "status", "status_reason", "host", "output_dir", "config_path", "config_hash")


class DamagedStore(Exception):
    """A store whose rows do not have the types apr wrote (hand-edited or corrupted)."""


def _check_row(row: dict) -> None:
    run = str(row.get("id"))[:40]
    for col in _NUMBER_COLUMNS:
        v = row.get(col)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise DamagedStore(f"run {run!r}: column {col!r} holds {type(v).__name__} {str(v)[:40]!r}, "
                               "expected a number")
    for col in _TEXT_COLUMNS:
        v = row.get(col)
        if v is not None and not isinstance(v, str):
            raise DamagedStore(f"run {run!r}: column {col!r} holds {type(v).__name__}, expected text")


def summarize(row: dict, store_path: Path | str, now: float, stale_after_s: float | None = None,
              parent: dict | None = None) -> dict:
    """A runs-table row as the documented `apr runs ls --json` object; ``parent``: the run and step
    ``apr train fork`` started it from (``store.fork_parents``). Raises DamagedStore when the row's
    values do not have the types apr writes."""
    _check_row(row)
    recorded = row.get("status")
    alive = trainer_alive(row.get("host"), row.get("pid"), row.get("heartbeat")) if recorded in ACTIVE_STATUSES \
        else None
    if alive is False:
        status = "dead"  # recorded here, and its PID no longer runs it: no need to wait for staleness
    elif recorded in ACTIVE_STATUSES and is_stale(row, now, stale_after_s):
        status = "stale"
    else:
        status = recorded
    started, ended, heartbeat = row.get("started"), row.get("ended"), row.get("heartbeat")
    if started is None:
        duration = None
    elif ended is not None:
        duration = ended - started
    elif status in ("stale", "dead") or recorded not in ACTIVE_STATUSES:
        duration = (heartbeat or started) - started
    else:
        duration = now - started
    return {
        "run_id": row.get("id"),
        "experiment": row.get("experiment"),
        "status": status,
        "recorded_status": recorded,
        "status_reason": row.get("status_reason"),
        "step": row.get("step"),
        "total_steps": row.get("total_steps"),
        "last_loss": row.get("last_loss"),
        "last_val_loss": row.get("last_val_loss"),
        "tokens_seen": row.get("tokens_seen"),
        "started_at": started,
        "ended_at": ended,
        "heartbeat": heartbeat,
        "duration_s": duration,
        "host": row.get("host"),
        "pid": row.get("pid"),
        "pid_alive": alive,
        "output_dir": row.get("output_dir"),
        "config_path": row.get("config_path"),
        "config_hash": row.get("config_hash"),
        "model_params": row.get("model_params"),
        "store": str(store_path),
        "parent": parent,
    }


def _check_status(status: str | None) -> None:
    if status is not None and status not in STATUS_FILTERS:
        raise AprError(
            f"unknown status {status!r}",
            [Finding("error", "runs.invalid_status", f"unknown status {status!r}",
                     expected=", ".join(STATUS_FILTERS), got=status)],
        )


def _stores(global_: bool, root: Path | None, apr_home: Path | None) -> list[Path]:
    if global_:
        path = global_db_path(apr_home)
        return [path] if path.is_file() else []
    return find_local_stores(Path.cwd() if root is None else Path(root))


def list_runs(
    *,
    global_: bool = False,
    root: Path | None = None,
    apr_home: Path | None = None,
    status: str | None = None,
    experiment: str | None = None,
    limit: int | None = None,
    now: float | None = None,
    stale_after_s: float | None = None,
) -> RunListing:
    """Runs newest first. ``global_``: the registry at ``$APR_HOME``; else the local stores under
    ``root`` (default: the current folder). ``status`` may be "stale" (recorded as running, no
    heartbeat for too long) or "dead" (recorded as running on this host, its PID gone). A run
    present in several local stores is listed once."""
    _check_status(status)
    if experiment is not None:
        validate_experiment(experiment)
    if limit is not None and limit < 0:
        raise AprError("--limit must be >= 0", [Finding("error", "runs.invalid_limit", "limit must be >= 0",
                                                       expected=">= 0", got=str(limit))])
    now = time.time() if now is None else now
    # Stale-ness is decided after the query, so a filter on an active status reads all active rows.
    # Any other query may stop at `limit` rows per store: a store's newest `limit` runs include every
    # run of the merged newest `limit` that it holds (a run's start time is the same in every store).
    if status in ("stale", "dead", *ACTIVE_STATUSES):
        sql_statuses: tuple[str, ...] | None = ACTIVE_STATUSES
        sql_limit = None
    else:
        sql_statuses = (status,) if status else None
        sql_limit = limit
    paths = _stores(global_, root, apr_home)
    listing = RunListing(runs=[], stores=[str(p) for p in paths])
    by_id: dict[str, dict] = {}
    for path in paths:
        try:
            conn = store.connect_readonly(path)
        except AprError as e:
            listing.warnings.append(e.message)
            continue
        try:
            rows = store.query_runs(conn, statuses=sql_statuses, experiment=experiment, limit=sql_limit)
            parents = store.fork_parents(conn)
            summaries = [summarize(row, path, now, stale_after_s, parents.get(row.get("id"))) for row in rows]
        except (sqlite3.Error, DamagedStore) as e:
            listing.warnings.append(f"{path}: cannot read runs, store skipped: {e}")
            continue
        finally:
            conn.close()
        for run in summaries:
            if status is not None and run["status"] != status:
                continue
            seen = by_id.get(run["run_id"])
            if seen is None or (run["heartbeat"] or 0) > (seen["heartbeat"] or 0):
                by_id[run["run_id"]] = run
    runs = sorted(by_id.values(), key=lambda r: (r["started_at"] or 0, r["run_id"]), reverse=True)
    listing.runs = runs[:limit] if limit is not None else runs
    return listing


def show_run(
    run_id: str,
    *,
    global_: bool = False,
    root: Path | None = None,
    apr_home: Path | None = None,
    now: float | None = None,
    stale_after_s: float | None = None,
    warnings: list[str] | None = None,
) -> dict:
    """Everything recorded about one run (a unique prefix of its id is enough). Without
    ``global_`` the local stores are searched first, then the registry. Stores that cannot be
    read are skipped and named in ``warnings``; a damaged store holding the run is an error.
    Each checkpoint carries ``exists``: whether its file is still on disk (pruned ones are not)."""
    warnings = [] if warnings is None else warnings
    validate_run_id(run_id)
    now = time.time() if now is None else now
    paths = _stores(global_, root, apr_home)
    if not global_:
        registry = global_db_path(apr_home)
        if registry.is_file():
            paths.append(registry)
    matches: dict[str, Path] = {}
    for path in paths:
        try:
            conn = store.connect_readonly(path)
        except AprError as e:
            warnings.append(e.message)
            continue
        try:
            for found in store.find_run_ids(conn, run_id):
                matches.setdefault(found, path)
        except sqlite3.Error as e:
            warnings.append(f"{path}: cannot read runs, store skipped: {e}")
        finally:
            conn.close()
        if run_id in matches:
            matches = {run_id: matches[run_id]}
            break
    if not matches:
        where = "the global registry" if global_ else "the stores under this folder or the global registry"
        raise AprError(f"no run {run_id!r} in {where}",
                       [Finding("error", "runs.not_found", f"no run {run_id!r} in {where}", got=run_id)])
    if len(matches) > 1:
        ids = ", ".join(sorted(matches))
        raise AprError(f"run id prefix {run_id!r} is ambiguous",
                       [Finding("error", "runs.ambiguous", f"{run_id!r} matches {ids}", got=run_id)])
    (full_id, path), = matches.items()
    conn = store.connect_readonly(path)
    try:
        row = store.get_run(conn, full_id)
        artifacts = store.artifacts(conn, full_id)
        metrics = store.final_metrics(conn, full_id)
        best = conn.execute(
            "SELECT step, value FROM metrics WHERE run_id = ? AND key = 'val_loss' AND value IS NOT NULL "
            "ORDER BY value ASC, step ASC LIMIT 1",
            (full_id,),
        ).fetchone()
        parent = store.fork_parents(conn).get(full_id)
        detail = {
            "run": summarize(row, path, now, stale_after_s, parent),
            "params": (params := store.run_params(conn, full_id)),
            "tags": {k[len(TAG_PREFIX):]: v for k, v in params.items() if k.startswith(TAG_PREFIX)},
            "final_metrics": metrics,
            "best_val_loss": None if best is None else {"step": best[0], "value": best[1]},
            "artifacts": artifacts,
            "checkpoints": [{**a, "exists": _exists(a.get("path"), path)} for a in artifacts
                            if a.get("kind") in CHECKPOINT_KINDS],
            "status_history": store.status_history(conn, full_id),
            "alerts": (alerts := store.alerts(conn, full_id)),
            "alert_counts": count_by_severity(alerts),
            "events": store.events(conn, full_id),
            "parent": parent,  # ``apr train fork``: the run and step this run started from, else None
        }
        # the final validation loss forecast from the curve so far (numpy: not for `apr runs ls`)
        from apr.track.forecast import forecast

        predicted = forecast(store.metric_series(conn, full_id, "val_loss"), int(row.get("total_steps") or 0))
        detail["forecast"] = None if predicted is None else predicted.to_dict()
    except (sqlite3.Error, DamagedStore) as e:
        raise AprError(f"{path}: cannot read run {full_id}: {e}",
                       [Finding("error", "track.store_damaged", f"cannot read run {full_id}: {e}", file=str(path),
                                expected="an apr experiment store")]) from None
    finally:
        conn.close()
    registry = global_db_path(apr_home)
    detail["forks"] = _forks_of(full_id, [path, registry] if registry.is_file() else [path])
    return detail


def _forks_of(run_id: str, paths: list[Path]) -> list[dict]:
    """``[{"run_id", "step"}]``: the runs ``apr train fork`` started from ``run_id``, by their fork step,
    from the given stores (a fork's own folder's store and the registry record it; the parent's
    folder does not)."""
    found: dict[str, dict] = {}
    for path in dict.fromkeys(paths):
        try:
            conn = store.connect_readonly(path)
        except AprError:
            continue
        try:
            for child, parent in store.fork_parents(conn).items():
                if parent.get("run_id") == run_id:
                    found.setdefault(child, {"run_id": child, "step": parent.get("step")})
        except sqlite3.Error:
            pass
        finally:
            conn.close()
    return sorted(found.values(), key=lambda f: (f["step"] if isinstance(f["step"], int) else -1, f["run_id"]))


def _exists(path, store_path: Path) -> bool:
    """Whether a recorded file is still there. A relative path was relative to the folder apply ran
    in, unknown here: it is also looked for in the run's output folder (the store's grandparent)."""
    if not isinstance(path, str):
        return False
    p = Path(path)
    return p.is_file() or (not p.is_absolute() and (store_path.parent.parent / p.name).is_file())


LEDGER_COLUMNS = ("run_id", "event", "step", "time", "micro_batch", "index", "shard", "row", "loss")


def ledger(detail: dict) -> list[dict]:
    """The bad-batch ledger of a run (``show_run``'s detail): one entry per data row that a skipped
    bad step or a rollback left out, with the event that did it, oldest first; ``loss``: the row's
    loss where its step was a logged one and its record is still there (``apr runs blame``), else None."""
    run_id = detail["run"]["run_id"]
    out = []
    for event in detail.get("events") or []:
        for row in (event.get("detail") or {}).get("rows") or []:
            out.append({"run_id": run_id, "event": event["kind"], "step": event["step"], "time": event["time"],
                        **{k: row.get(k) for k in ("micro_batch", "index", "shard", "row")}, "loss": None})
    if out:
        losses = _recorded_losses(detail, {e["micro_batch"] for e in out if isinstance(e["micro_batch"], int)})
        for e in out:
            e["loss"] = losses.get((e["micro_batch"], e["index"]))
    return out


def _recorded_losses(detail: dict, micro_batches: set[int]) -> dict[tuple, float]:
    """``{(micro_batch, data_index): loss}`` of the given micro-batches from the run's own store."""
    folder = detail["run"].get("output_dir")
    path = Path(folder) / ".apr" / "experiments.db" if folder else None
    if path is None or not path.is_file() or not micro_batches:
        return {}
    try:
        conn = store.connect_readonly(path)
    except AprError:
        return {}
    try:
        return store.row_losses_of(conn, detail["run"]["run_id"], sorted(micro_batches))
    except sqlite3.Error:
        return {}
    finally:
        conn.close()
