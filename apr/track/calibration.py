"""The calibration store: probe results (apr/probe.py) in the global registry's ``calibrations``
table (docs/plan.md, "Probe"), keyed by device, software versions and the run's shape, and what
a later plan on the same device takes from them (``plan_calibration``). Torch-free: the plan reads
the torch version from the installed package's metadata, never by importing it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sqlite3
import statistics
import time
from importlib import metadata
from pathlib import Path

from apr.track.names import global_db_path
from apr.track.store import StoreWriter, connect_readonly

SHAPE_KEYS = ("architecture", "batch_size", "seq_len", "gradient_accumulation", "mixed_precision", "engine",
              "kernels", "execution")


def shape(config, execution_policy: dict) -> dict:
    """What makes two probes comparable besides the device and the versions."""
    tr = config.training
    return {"architecture": config.model.architecture.model_dump(mode="json"),
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


def _rows(where: str = "", params: tuple = (), apr_home: Path | None = None) -> list[dict]:
    path = global_db_path(apr_home)
    if not path.is_file():
        return []
    conn = connect_readonly(path)
    try:
        if conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='calibrations'").fetchone() is None:
            return []
        rows = conn.execute("SELECT id, time, device, device_name, torch, cuda, apr, shape_key, shape, result "
                            f"FROM calibrations {where} ORDER BY time, id", params).fetchall()
    except sqlite3.Error:
        return []
    finally:
        conn.close()
    return [{**dict(r), "shape": json.loads(r["shape"]), "result": json.loads(r["result"])} for r in rows]


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


def summary(rows: list[dict]) -> dict | None:
    """What a plan takes from matching records: the median tokens/s of finished runs of this shape
    when there are any (their wall time includes validation, checkpoints and the loop's own work),
    else of probes (the engine's step alone); and the probes' transient-memory ratio."""
    if not rows:
        return None
    runs = [r for r in rows if r["result"].get("source") == "run"]
    probes = [r for r in rows if r["result"].get("source", "probe") == "probe"]
    timed = [r["result"] for r in (runs or probes)]
    ratios = [r["result"]["transient_bytes"] / r["result"]["modelled_transient_bytes"] for r in probes
              if r["result"].get("modelled_transient_bytes")]
    last = max(r["time"] for r in rows)
    what = f"{len(runs)} run{'s' if len(runs) != 1 else ''}" if runs else \
        f"{len(probes)} probe{'s' if len(probes) != 1 else ''}"
    return {"probes": len(probes), "runs": len(runs), "what": what, "last": last,
            "date": time.strftime("%Y-%m-%d", time.gmtime(last)),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "step_seconds": statistics.median(r["step_seconds"] for r in timed),
            "startup_seconds": statistics.median(r["startup_seconds"] for r in timed) if runs else None,
            "transient_ratio": statistics.median(ratios) if ratios else None,
            "device_name": rows[-1]["device_name"], "ids": [r["id"] for r in rows]}
