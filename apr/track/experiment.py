"""`apr experiment view/export`: compare runs of one store in the terminal, export a run's metrics.

plotext and pyarrow are imported inside the functions that use them.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.errors import AprError, Finding
from apr.fsutil import check_output_file, check_output_folder, is_sqlite_file, output_path
from apr.track import store
from apr.track.names import validate_run_id
from apr.track.trackers import (
    EXTRA,
    PACKAGES,
    MlflowSink,
    TensorBoardSink,
    local_target_problem,
    missing_package,
    mlflow_local_target,
)

MAX_DEFAULT_RUNS = 8  # runs drawn when --runs is not given (newest first); more is unreadable
MARKERS = ("x", "o", "+", "*", "#", "@", "%", "&", "=", "~")
EXPORT_FORMATS = ("parquet", "csv")


@dataclass
class Series:
    run_id: str
    points: list[tuple[int, float]]


@dataclass
class ExperimentView:
    db: Path
    metric: str
    series: list[Series]
    params: dict[str, dict[str, Any]]  # run_id -> {param: value}
    omitted_runs: int = 0  # runs left out of the default selection
    notes: list[str] = field(default_factory=list)
    parents: dict[str, dict] = field(default_factory=dict)  # a fork's run id -> its parent {"run_id", "step"}

    def label(self, run_id: str) -> str:
        """The run's id, and for a fork the run and step it started from: ``ID (fork of P@S)``."""
        parent = self.parents.get(run_id)
        return run_id if parent is None else f"{run_id} (fork of {parent.get('run_id')}@{parent.get('step')})"


def _with_forks(ids: list[str], parents: dict[str, dict]) -> list[str]:
    """``ids`` and, after each, the runs forked from it (and from those), oldest fork step first."""
    children: dict[str, list[str]] = {}
    for child, parent in sorted(parents.items(), key=lambda kv: (kv[1].get("step") or 0, kv[0])):
        children.setdefault(parent.get("run_id"), []).append(child)
    out: list[str] = []

    def add(run_id: str) -> None:
        if run_id in out:
            return
        out.append(run_id)
        for child in children.get(run_id, []):
            add(child)

    for run_id in ids:
        add(run_id)
    return out


def resolve_db(path: Path | str) -> Path:
    """A store file, or a run folder holding ``.apr/experiments.db``, or an APR_HOME holding
    ``experiments.db``. Raises AprError when none is there."""
    p = Path(path)
    for candidate in (p, p / ".apr" / "experiments.db", p / "experiments.db"):
        if candidate.is_file():
            return candidate
    raise AprError(
        f"no experiment store at {p}",
        [Finding("error", "experiment.no_store", f"no experiment store at {p}", file=str(p),
                 expected="an experiments.db file, or a run folder with .apr/experiments.db")],
    )


def _open(db: Path | str) -> tuple[Path, sqlite3.Connection]:
    path = resolve_db(db)
    return path, store.connect_readonly(path)


def _damaged(path: Path, err: Exception) -> AprError:
    message = f"cannot read the experiment store {path}: {err}"
    return AprError(message, [Finding("error", "track.store_damaged", message, file=str(path),
                                      expected="an apr experiment store")])


def _check_experiment(conn: sqlite3.Connection, experiment: str) -> set[str]:
    """The ids of ``experiment``'s runs; AprError naming the store's experiments when it has none."""
    ids = {r["id"] for r in store.query_runs(conn, experiment=experiment)}
    if not ids:
        known = sorted({r["experiment"] for r in store.query_runs(conn)})
        raise AprError(f"no experiment {experiment!r} in this store", [Finding(
            "error", "experiment.not_found", f"no runs of experiment {experiment!r}", path="--experiment",
            expected="one of " + (", ".join(known) if known else "(no experiments: the store is empty)"),
            got=experiment)])
    return ids


def _select_runs(conn: sqlite3.Connection, wanted: list[str] | None,
                 experiment: str | None = None) -> tuple[list[str], int]:
    """Full run ids for ``wanted`` (ids or unique prefixes), or the newest runs when None; with
    ``experiment``, only that experiment's runs (a wanted run of another is refused)."""
    members = _check_experiment(conn, experiment) if experiment is not None else None
    if not wanted:
        rows = store.query_runs(conn, experiment=experiment)
        ids = [r["id"] for r in rows]
        return ids[:MAX_DEFAULT_RUNS], max(0, len(ids) - MAX_DEFAULT_RUNS)
    out = []
    for name in wanted:
        validate_run_id(name)
        found = store.find_run_ids(conn, name)
        exact = [f for f in found if f == name]
        found = exact or found
        if not found:
            raise AprError(f"no run {name!r} in this store",
                           [Finding("error", "runs.not_found", f"no run {name!r} in this store", got=name)])
        if len(found) > 1:
            raise AprError(f"run id prefix {name!r} is ambiguous",
                           [Finding("error", "runs.ambiguous", f"{name!r} matches {', '.join(sorted(found))}",
                                    got=name)])
        if members is not None and found[0] not in members:
            raise AprError(f"run {found[0]} is not in experiment {experiment!r}", [Finding(
                "error", "experiment.run_elsewhere", "the run belongs to another experiment", path="--runs",
                expected=f"a run of {experiment!r}", got=found[0])])
        if found[0] not in out:
            out.append(found[0])
    return out, 0


def _decimate(points: list[tuple[int, float]], max_points: int) -> list[tuple[int, float]]:
    if len(points) <= max_points:
        return points
    stride = -(-len(points) // max_points)
    kept = points[::stride]
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept


def load_view(
    db: Path | str, runs: list[str] | None = None, metric: str = "loss", max_points: int = 2000,
    experiment: str | None = None, forks: bool = False,
) -> ExperimentView:
    """The curves of ``metric`` (step, value) for the chosen runs (of ``experiment`` only, when
    given) and their params; with ``forks``, also the runs ``apr train fork`` started from them
    (and from those), each after its parent."""
    path, conn = _open(db)
    try:
        ids, omitted = _select_runs(conn, runs, experiment)
        parents = store.fork_parents(conn)
        if forks:
            ids = _with_forks(ids, parents)
        series, params, notes = [], {}, []
        for run_id in ids:
            points = [(int(s), float(v)) for s, v in store.metric_series(conn, run_id, metric) if v is not None]
            if not points:
                notes.append(f"run {run_id} has no {metric!r} values")
            series.append(Series(run_id, _decimate(points, max_points)))
            params[run_id] = store.run_params(conn, run_id)
    except (sqlite3.Error, TypeError, ValueError) as e:  # a dropped table, text where a number belongs
        raise _damaged(path, e) from None
    finally:
        conn.close()
    if omitted:
        notes.append(f"{omitted} older run(s) not shown; choose runs with --runs A,B")
    return ExperimentView(db=path, metric=metric, series=series, params=params, omitted_runs=omitted, notes=notes,
                          parents={r: p for r, p in parents.items() if r in params})


def render_chart(view: ExperimentView, width: int = 100, height: int = 24, colour: bool = False) -> str:
    """The metric's curves of every run in one plotext chart, as text (no TTY needed)."""
    import plotext as plt

    fig = plt.figure
    fig.clear()
    fig.parent().limit(False, False)  # the asked width wins over the terminal's (or the 80 of a pipe)
    fig.plot_size(max(width, 40), max(height, 10))
    fig.theme("default" if colour else "colorless")
    drawn = 0
    for i, s in enumerate(view.series):
        if not s.points:
            continue
        xs = [p[0] for p in s.points]
        ys = [p[1] for p in s.points]
        fig.draw(fig.signal(xs, ys, marker=MARKERS[i % len(MARKERS)]).label(view.label(s.run_id)).lines(True))
        drawn += 1
    if not drawn:
        return f"(no {view.metric!r} values to plot)"
    fig.title(f"{view.metric} by step").label("step", axis=0)
    return fig.build().string(colorless=not colour)


def render_bars(view: ExperimentView, width: int = 100) -> str:
    """Each run's last value of the metric as one bar from zero (an eval score across stages, the
    final loss of a sweep), in the order of the selection, as text. Drawn with block characters:
    plotext's horizontal bars put every bar at the same length in this version."""
    last = [(view.label(s.run_id), s.points[-1]) for s in view.series if s.points]
    if not last:
        return f"(no {view.metric!r} values to plot)"
    labels = [f"{rid} @{step}" for rid, (step, _) in last]
    values = [v for _, (_, v) in last]
    pad = max(len(label) for label in labels)
    room = max(width - pad - 14, 10)
    top = max((abs(v) for v in values), default=0.0) or 1.0
    lines = [f"{view.metric}: last value per run"]
    lines += [f"{label.ljust(pad)}  {'█' * round(room * max(v, 0.0) / top):<{room}}  {v:.4g}"
              for label, v in zip(labels, values, strict=True)]
    return "\n".join(lines)


def param_table(view: ExperimentView, all_params: bool = False) -> tuple[list[str], list[list[str]], int]:
    """(header, rows, hidden): one row per param, one column per run. With several runs and not
    ``all_params``, params equal across all runs are hidden and counted."""
    run_ids = [s.run_id for s in view.series]
    keys = sorted({k for p in view.params.values() for k in p})
    rows, hidden = [], 0
    for key in keys:
        values = [view.params.get(r, {}).get(key) for r in run_ids]
        if not all_params and len(run_ids) > 1 and all(v == values[0] for v in values):
            hidden += 1
            continue
        rows.append([key, *[_cell(v) for v in values]])
    return ["param", *run_ids], rows, hidden


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# -------------------------------------------------------------------------------------- export


@dataclass
class ExportResult:
    path: Path
    rows: int
    columns: list[str]


def export_run(db: Path | str, run_id: str, fmt: str, output: Path | str, overwrite: bool = False) -> ExportResult:
    """Write one run's metrics as a table: one row per step, columns ``step``, ``time`` (the
    latest record time of that step) and one column per metric (null where not logged). The
    output must be a new path (or an existing regular file with ``overwrite``), never the store."""
    if fmt not in EXPORT_FORMATS:
        raise AprError(f"unknown export format {fmt!r}",
                       [Finding("error", "experiment.invalid_format", f"unknown export format {fmt!r}",
                                expected=" or ".join(EXPORT_FORMATS), got=fmt)])
    validate_run_id(run_id)
    path = resolve_db(db)
    store_files = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
    check_output_file(output, inputs=store_files, overwrite=overwrite)
    conn = store.connect_readonly(path)
    try:
        (full_id,), _ = _select_runs(conn, [run_id])
        rows = [(int(s), str(k), None if v is None else float(v), float(t)) for s, k, v, t in
                store.metric_rows(conn, full_id)]
    except (sqlite3.Error, TypeError, ValueError) as e:
        raise _damaged(path, e) from None
    finally:
        conn.close()
    import pyarrow as pa

    keys = sorted({r[1] for r in rows})
    by_step: dict[int, dict[str, Any]] = {}
    for step, key, value, t in rows:
        rec = by_step.setdefault(step, {"time": t})
        rec[key] = value  # the later record of a step wins (rows are ordered by time)
        rec["time"] = max(rec["time"], t)
    steps = sorted(by_step)
    columns = {"step": pa.array(steps, pa.int64()), "time": pa.array([by_step[s]["time"] for s in steps], pa.float64())}
    for key in keys:
        columns[key] = pa.array([by_step[s].get(key) for s in steps], pa.float64())
    table = pa.table(columns)
    out = Path(output)
    with output_path(out, inputs=store_files, overwrite=overwrite) as tmp:  # checked again at the write
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, tmp)
    return ExportResult(path=out, rows=table.num_rows, columns=table.column_names)


TRACKERS = ("tensorboard", "mlflow")


@dataclass
class TrackerExport:
    runs: list[tuple[str, int, str]]  # (run id, metric points written, where)
    skipped: list[tuple[str, str]]  # (run id, why)


def export_to_tracker(db: Path | str, run_ids: list[str] | None, tracker: str, dest: str,
                      overwrite: bool = False) -> TrackerExport:
    """Write recorded runs' metrics to TensorBoard (``dest``: a log folder; each run under
    ``<experiment>/<run_id>``, replacing an earlier export of it) or MLflow (``dest``: a tracking
    URI, or a path for a SQLite store; a run already there is skipped unless ``overwrite``), through
    the same sinks a live run uses (apr/track/trackers.py)."""
    if tracker not in TRACKERS:
        raise AprError(f"unknown tracker {tracker!r}", [Finding("error", "experiment.invalid_tracker",
                       f"unknown tracker {tracker!r}", expected=" or ".join(TRACKERS), got=tracker)])
    if missing_package(tracker):
        raise AprError(f"exporting to {tracker} needs the '{PACKAGES[tracker]}' package: pip install 'apr[{EXTRA}]'",
                       [Finding("error", "experiment.tracker_package", f"'{PACKAGES[tracker]}' is not installed",
                                expected=f"pip install 'apr[{EXTRA}]'", got="not installed")])
    path = resolve_db(db)
    dest = _checked_tracker_dest(tracker, dest, [path, Path(f"{path}-wal"), Path(f"{path}-shm")])
    conn = store.connect_readonly(path)
    try:
        ids, _ = _select_runs(conn, run_ids) if run_ids else ([r["id"] for r in store.query_runs(conn)], 0)
        runs = {r["id"]: r for r in store.query_runs(conn)}
        data = {rid: [(rid, int(s), str(k), None if v is None else float(v), float(t))
                      for s, k, v, t in store.metric_rows(conn, rid)] for rid in ids}
    except (sqlite3.Error, TypeError, ValueError) as e:
        raise _damaged(path, e) from None
    finally:
        conn.close()
    if tracker == "mlflow" and "://" not in dest:
        dest = f"sqlite:///{Path(dest).resolve()}"
    local = (Path(dest), "folder") if tracker == "tensorboard" else mlflow_local_target(dest)
    problem = local_target_problem(*local) if local is not None else None
    if problem is not None:  # a read-only folder: refused before any work, never a traceback half-way
        raise AprError(f"--out {dest}: cannot write the {tracker} export: {problem}", [Finding(
            "error", "experiment.output", f"cannot write the {tracker} export: {problem}", path="--out",
            file=str(local[0]), expected="a folder (or SQLite file) apr can write", got=problem)])
    try:
        return _export_runs(tracker, dest, ids, runs, data, overwrite)
    except OSError as err:  # the disk filled, permissions changed while writing
        raise AprError(f"--out {dest}: writing the {tracker} export failed: {err.strerror or err}", [Finding(
            "error", "experiment.output", f"writing the {tracker} export failed", path="--out", file=dest,
            expected="a folder (or SQLite file) apr can write", got=str(err.strerror or err))]) from None


def _export_runs(tracker: str, dest: str, ids: list[str], runs: dict, data: dict, overwrite: bool) -> TrackerExport:
    out = TrackerExport([], [])
    if tracker == "tensorboard":
        Path(dest).mkdir(parents=True, exist_ok=True)
    for rid in ids:
        experiment = runs.get(rid, {}).get("experiment") or "default"
        status = runs.get(rid, {}).get("status")
        if tracker == "tensorboard":
            log_dir = Path(dest) / experiment / rid
            if os.path.lexists(log_dir):
                if not overwrite:
                    out.skipped.append((rid, f"already in {log_dir} (--overwrite replaces it)"))
                    continue
                check_output_folder(log_dir, option="--out")  # never through a symlink or onto a file
            sink = TensorBoardSink(Path(dest), experiment, rid, resume_step=-1)  # purge: replace an earlier export
            where = str(sink.log_dir)
        else:
            sink = MlflowSink(dest, experiment, rid, create=overwrite)
            where = f"{dest} run {sink.run_id}"
            if sink.existed and not overwrite:
                out.skipped.append((rid, f"already in {dest} (--overwrite replaces it)"))
                continue
        sink.write(data[rid])
        sink.close(status if status in ("finished", "stopped", "failed") else None)
        out.runs.append((rid, sum(1 for r in data[rid] if r[3] is not None), where))
    return out


def _checked_tracker_dest(tracker: str, dest: str, inputs: list[Path]) -> str:
    """``--out`` / ``--uri`` of a tracker export, refused before any work when it would write over
    something else: TensorBoard wants a folder (not a file, a FIFO, a device, a symlink, apr's
    records); MLflow wants a SQLite file that is its own store (new, or an MLflow database: never
    apr's store, the export's input, a file of another kind, a FIFO or a device). A remote URI
    (http, https, databricks) is the tracker's business."""
    option = "--out"
    if tracker == "mlflow" and "://" in dest:
        scheme, _, rest = dest.partition("://")
        if scheme == "sqlite":
            target = rest[1:] if rest.startswith("/") else rest  # sqlite:///rel.db, sqlite:////abs.db
            option = "--uri"
        elif scheme == "file":
            check_output_folder(rest, inputs=inputs, option="--uri")
            return dest
        else:
            return dest
    else:
        target = dest
    if tracker == "tensorboard":
        check_output_folder(target, inputs=inputs, option=option)
        return dest
    checked = check_output_file(target, inputs=inputs, overwrite=True, option=option, sqlite_ok=True)
    if checked.exists() and not is_sqlite_file(checked):
        message = f"{option} {target} exists and is not a SQLite database; --to mlflow writes an MLflow store"
        raise AprError(message, [Finding("error", "output.refused", message, path=option, file=str(target),
                                         expected="a new path or an MLflow SQLite store", got="another file")])
    return dest
