"""The calibration store: probe results (apr/probe.py) in the global registry's ``calibrations``
table (docs/plan.md, "Probe"), keyed by device, software versions and the run's shape, and what
a later plan on the same device takes from them (``plan_calibration``). Torch-free: the plan reads
the torch version from the installed package's metadata, never by importing it.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sqlite3
import statistics
import time
from importlib import metadata
from pathlib import Path

from apr.errors import AprError
from apr.quoting import describe
from apr.track.names import global_db_path
from apr.track.store import StoreWriter, connect_readonly

SHAPE_KEYS = ("architecture", "batch_size", "seq_len", "gradient_accumulation", "mixed_precision", "engine",
              "kernels", "execution")


def shape(config, execution_policy: dict, threads: int | None = None) -> dict:
    """What makes two probes comparable besides the device and the versions; on the CPU also the
    intra-op threads (apr/threads.py): one thread and two are different machines."""
    tr = config.training
    extra = {} if threads is None else {"cpu_threads": int(threads)}
    return {**extra, "architecture": config.model.architecture.model_dump(mode="json"),
            "batch_size": config.data.batch_size, "seq_len": config.data.seq_len,
            "gradient_accumulation": tr.gradient_accumulation, "mixed_precision": str(tr.mixed_precision),
            "engine": str(tr.engine), "kernels": str(tr.kernels), "execution": execution_policy}


def shape_key(shape_doc: dict) -> str:
    return hashlib.sha256(json.dumps(shape_doc, sort_keys=True).encode()).hexdigest()[:16]


def torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def record(result: dict, shape_doc: dict, apr_home: Path | None = None) -> int:
    """Store one probe result; returns its id. The global store is created or migrated as a run's is."""
    writer = StoreWriter(global_db_path(apr_home))
    writer.open()
    try:
        conn = writer.db.conn
        versions = result["versions"]
        cur = conn.execute(
            "INSERT INTO calibrations (time, device, device_name, torch, cuda, apr, shape_key, shape, result) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time(), result["device"], result["device_name"], versions["torch"], versions["cuda"],
             versions["apr"], shape_key(shape_doc), json.dumps(shape_doc, sort_keys=True),
             json.dumps(result, allow_nan=False)))
        return int(cur.lastrowid)
    finally:
        writer.close()


SKIPPED: list[dict] = []  # rows the last read skipped: {"id", "reason"} (the plan and `calibration ls` warn)


def _number(value, positive: bool = False) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value > 0 if positive else True)


def _malformed(row: dict) -> str | None:
    """Why a stored row cannot be used, or None. Every field a reader of the store touches is
    checked here, so one bad row (hand-edited, another version's, torn) is skipped, not a crash."""
    if not _number(row.get("time")):
        return f"time is {describe(row.get('time'))}, expected a number"
    for key in ("device", "device_name", "apr", "shape_key"):
        if not isinstance(row.get(key), str):
            return f"{key} is {describe(row.get(key))}, expected text"
    for key in ("shape", "result"):
        try:
            row[key] = json.loads(row[key]) if isinstance(row[key], (str, bytes)) else None
        except (ValueError, RecursionError) as err:
            return f"{key} is not valid JSON ({type(err).__name__}: {str(err)[:80]})"
        if not isinstance(row[key], dict):
            return f"{key} is {type(row[key]).__name__}, expected a JSON object"
    shape_doc, result = row["shape"], row["result"]
    arch = shape_doc.get("architecture")
    if not isinstance(arch, dict) or not all(_number(arch.get(k), True) for k in ("num_hidden_layers", "hidden_size")):
        return "shape.architecture lacks num_hidden_layers / hidden_size"
    if not all(_number(shape_doc.get(k), True) for k in ("batch_size", "seq_len")):
        return "shape lacks batch_size / seq_len"
    for key in ("tokens_per_s", "step_seconds"):
        if not _number(result.get(key), True):
            return f"result.{key} is {describe(result.get(key))}, expected a positive number"
    if result.get("source", "probe") not in ("probe", "run"):
        return f"result.source is {describe(result.get('source'))}, expected probe or run"
    for key in ("startup_seconds", "transient_bytes", "modelled_transient_bytes", "load", "threads",
                "actual_seconds", "base_seconds", "load_factor", "load_at_end", "compile_seconds"):
        if result.get(key) is not None and not _number(result[key]):
            return f"result.{key} is {describe(result[key])}, expected a number"
    times = result.get("step_seconds_all")
    if times is not None and not (isinstance(times, list) and all(_number(t, True) for t in times)):
        return "result.step_seconds_all is not a list of positive numbers"
    if not isinstance(result.get("rows", []), list) or not all(
            isinstance(r, dict) and isinstance(r.get("component"), str) and _number(r.get("measured"))
            and (r.get("modelled") is None or _number(r.get("modelled"))) for r in result.get("rows", [])):
        return "result.rows is not a list of {component, modelled, measured}"
    return None


def _rows(where: str = "", params: tuple = (), apr_home: Path | None = None) -> list[dict]:
    """Stored rows, oldest first; malformed ones are left out and listed in ``SKIPPED``."""
    SKIPPED.clear()
    path = global_db_path(apr_home)
    if not path.is_file():
        return []
    try:
        conn = connect_readonly(path)
    except AprError as err:
        SKIPPED.append({"id": None, "reason": f"the registry {path} cannot be read: {err.message}"})
        return []
    try:
        if conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='calibrations'").fetchone() is None:
            return []
        rows = conn.execute("SELECT id, time, device, device_name, torch, cuda, apr, shape_key, shape, result "
                            f"FROM calibrations {where} ORDER BY id", params).fetchall()
    except sqlite3.Error as err:
        SKIPPED.append({"id": None, "reason": f"the calibrations table of {path} cannot be read: {err}"})
        return []
    finally:
        conn.close()
    out = []
    for r in rows:
        row = dict(r)
        reason = _malformed(row)
        if reason is None:
            out.append(row)
        else:
            SKIPPED.append({"id": row.get("id"), "reason": reason})
    return sorted(out, key=lambda row: (row["time"], row["id"]))


def skipped_warnings() -> list[str]:
    """One line per row the last read skipped, naming it (for the plan and `apr calibration ls`)."""
    return [f"calibration row {s['id']} skipped: {s['reason']}" if s["id"] is not None else
            f"calibrations skipped: {s['reason']}" for s in SKIPPED]


def host_cpu_name() -> str:
    """The name a CPU probe is stored under (the same call in apr/probe.py)."""
    return platform.processor() or platform.machine() or "cpu"


def list_calibrations(apr_home: Path | None = None) -> list[dict]:
    return _rows(apr_home=apr_home)


def matching(device: str, device_name: str, shape_doc: dict, apr_version: str,
             apr_home: Path | None = None) -> list[dict]:
    """Probes of this shape on this device with this torch and apr."""
    return _rows("WHERE device = ? AND device_name = ? AND shape_key = ? AND torch IS ? AND apr = ?",
                 (device, device_name, shape_key(shape_doc), torch_version(), apr_version), apr_home)


def matching_shape(device: str, shape_doc: dict, apr_version: str, apr_home: Path | None = None) -> list[dict]:
    """Probes of this shape on any device of a kind (the caller picks the device by name)."""
    return _rows("WHERE device = ? AND shape_key = ? AND torch IS ? AND apr = ?",
                 (device, shape_key(shape_doc), torch_version(), apr_version), apr_home)


RECENT = 8  # finished runs the correction learns from: older ones describe older load and code
POOLED = 3  # latest probes whose median is the basis: one probe of a few steps can hit a load spike


def log_spread(values: list[float]) -> float:
    """The largest distance of ``values`` from their median, in log space (0.1 = about +-10%)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return max(abs(math.log(v / mid)) for v in values)


def _finished_ratio(result: dict) -> float | None:
    """A finished run's actual seconds over the uncorrected estimate its plan made, net of the load
    change between its probe and the run (None when its plan had no calibrated estimate)."""
    actual, base = result.get("actual_seconds"), result.get("base_seconds")
    if not (actual and base):
        return None
    actual = max(actual - (result.get("compile_seconds") or 0.0), 1e-9)  # compiling is its own term, not in base
    load = result.get("load_factor")  # the cores' contention during the run over the probe's
    return actual / base / (load if load and load > 0 else 1.0)


def compile_summary(results: list[dict]) -> dict:
    """What compiling cost the probes and runs of a compiled shape (apr/train/calibrate.py keeps it
    out of their step time): the median seconds with inductor's cache ``cold`` and ``warm``, and
    the cache folders they filled."""
    dirs = {r["compile_cache_dir"] for r in results if isinstance(r.get("compile_cache_dir"), str)}
    out: dict = {"dirs": sorted(dirs)}
    for cache in ("cold", "warm"):
        seconds = [r["compile_seconds"] for r in results[-RECENT:]
                   if r.get("compile_cache") == cache and _number(r.get("compile_seconds"), True)]
        if seconds:
            out[cache] = statistics.median(seconds)
    return out


def summary(rows: list[dict]) -> dict | None:
    """What a plan takes from matching records (docs/plan.md, "The time estimate's range").

    - ``basis``: ``probe`` when there are probes (the median of the latest ``POOLED``: recent, so
      they saw the machine's load of the moment, and more than one, so one load spike does not
      decide), else ``run`` (the median tokens/s of finished runs, whose wall time includes
      validation, checkpoints and the loop's own work, and their start-up);
    - ``correction``: on a probe basis, the median of actual / estimated seconds over the last
      ``RECENT`` finished runs whose plan estimated from a probe (what a probe does not see: the
      loop's own work, validation, checkpoints, data), net of each run's load change, shrunk toward
      1 by n / (n + 1) for n runs; its spread is that of the ratios and the shrunk distance;
    - ``spread``: the basis's own scatter in log space: the pooled probes' timed steps, or the
      runs' tokens/s;
    - the probes' transient-memory ratio, as before."""
    if not rows:
        return None
    runs = [r for r in rows if r["result"].get("source") == "run"]
    probes = [r for r in rows if r["result"].get("source", "probe") == "probe"]
    timed = [r["result"] for r in (runs or probes)]
    ratios = [r["result"]["transient_bytes"] / r["result"]["modelled_transient_bytes"] for r in probes
              if r["result"].get("modelled_transient_bytes") and r["result"].get("transient_bytes") is not None]
    last = max(r["time"] for r in rows)
    out = {"probes": len(probes), "runs": len(runs), "last": last,
           "date": time.strftime("%Y-%m-%d", time.gmtime(last)),
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
           "step_seconds": statistics.median(r["step_seconds"] for r in timed),
           "startup_seconds": statistics.median(r.get("startup_seconds") or 0.0 for r in timed) if runs else None,
           "transient_ratio": statistics.median(ratios) if ratios else None,
           "device_name": rows[-1]["device_name"], "ids": [r["id"] for r in rows], "correction": None}
    plural = lambda n, what: f"{n} {what}{'s' if n != 1 else ''}"  # noqa: E731
    out["compile"] = compile_summary([r["result"] for r in rows])
    if probes:
        pool = [r["result"] for r in probes[-POOLED:]]
        when = probes[-1]["time"]
        steps = [t for p in pool for t in (p.get("step_seconds_all") or [p["step_seconds"]])]
        loads = [p["load"] for p in pool if p.get("load") is not None]
        startups = [p["startup_seconds"] for p in pool if p.get("startup_seconds") is not None]
        out.update(basis="probe", basis_id=probes[-1]["id"],
                   tokens_per_s=statistics.median(p["tokens_per_s"] for p in pool),
                   step_seconds=statistics.median(p["step_seconds"] for p in pool),
                   startup_seconds=statistics.median(startups) if startups else None,
                   spread=log_spread(steps), spread_of=plural(len(steps), "probe step"),
                   load=statistics.median(loads) if loads else None, threads=pool[-1].get("threads"),
                   basis_time=when, date=time.strftime("%Y-%m-%d", time.gmtime(when)))
        finished = [(r["id"], x) for r in runs if r["result"].get("base_kind") == "probe"
                    and (x := _finished_ratio(r["result"])) is not None][-RECENT:]
        if finished:
            values = [x for _, x in finished]
            n, raw = len(values), statistics.median(values)
            # few runs say little: shrink toward 1 and count the distance as uncertainty
            out["correction"] = {"factor": math.exp(math.log(raw) * n / (n + 1)), "raw_factor": raw, "runs": n,
                                 "spread": math.sqrt(log_spread(values) ** 2 + math.log(raw) ** 2 / (n + 1)),
                                 "ratios": values, "ids": [i for i, _ in finished]}
        pooled = plural(1, "probe") if len(pool) == 1 else f"the median of the last {plural(len(pool), 'probe')}"
        out["what"] = pooled + (f", corrected by {plural(len(finished), 'finished run')}" if finished else "")
    else:
        recent = [r["result"] for r in runs[-RECENT:]]
        rates = [r["tokens_per_s"] for r in recent]
        loads = [r["load"] for r in recent if r.get("load") is not None]
        out.update(basis="run", basis_id=runs[-1]["id"], tokens_per_s=statistics.median(rates),
                   step_seconds=statistics.median(r["step_seconds"] for r in recent),
                   startup_seconds=statistics.median(r.get("startup_seconds") or 0.0 for r in recent),
                   spread=log_spread(rates), spread_of=plural(len(rates), "finished run"),
                   load=statistics.median(loads) if loads else None, threads=recent[-1].get("threads"),
                   basis_time=runs[-1]["time"], what=plural(len(runs), "run"))
    return out
