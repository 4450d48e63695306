"""Tolerant reading of `<run_dir>/training_state.json` for the monitor.

The trainer replaces the file atomically, but the monitor must still survive anything it finds: no
file yet, an empty or half-written file (a non-atomic writer, a full disk), a newer schema, fields
missing or of the wrong type. `StateReader.poll()` never raises: it returns a `Reading` that either
carries a normalised state (every known field present, wrong types turned into None) or says what
is wrong, and it re-reads only when the file's identity (inode, size, mtime) changed, so watching
an idle run costs one `stat` per refresh.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.readers import MAX_JSON_DEPTH, InputError, read_bytes, too_deep_at
from apr.track.liveness import trainer_alive

STATE_FILE = "training_state.json"
SCHEMA_VERSION = 1
ACTIVE_STATUSES = ("starting", "running")
ENDED_STATUSES = ("finished", "failed", "stopped")
KNOWN_STATUSES = ACTIVE_STATUSES + ENDED_STATUSES
# An active run whose heartbeat is older than this (at least) is shown as stale: the same floor as
# `apr runs ls` (apr.track.state.STALE_AFTER_S), so the two never disagree about a run.
STALE_FLOOR_S = 120.0
MAX_STATE_BYTES = 16 * 2**20  # apr.readers.LIMITS['state']: the writer bounds its histories

HISTORY_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s")

# Field -> kind; the monitor shows what it finds and lists what it misses.
_FIELD_KINDS: dict[str, str] = {
    "run_id": "str",
    "experiment": "str",
    "status": "str",
    "status_reason": "str",
    "pid": "int",
    "host": "str",
    "started_at": "num",
    "heartbeat": "num",
    "ended_at": "num",
    "step": "int",
    "total_steps": "int",
    "epoch": "num",
    "loss": "num",
    "val_loss": "num",
    "val_ppl": "num",
    "lr": "num",
    "grad_norm": "num",
    "tokens_per_s": "num",
    "tokens_seen": "num",
    "tokens_total": "num",
    "elapsed_s": "num",
    "eta_s": "num",
    "last_checkpoint": "checkpoint",
    "gpu": "gpu",
    "alerts": "alerts",
    "store_warnings": "strings",
    "output_dir": "str",
    "config_path": "str",
    "model_params": "num",
}
# Written by the tracker but not part of the fields every version-1 writer must provide.
_OPTIONAL_FIELDS = {"log_period_s": "num", "evals": "evals", "samples": "samples", "events": "events",
                   "block_norms": "block_norms", "cost": "cost", "mfu": "num", "hfu": "num", "drift": "drift",
                   "mixture": "mixture", "data_drift": "numbers", "histograms": "histograms",
                   "eval_history": "eval_history", "moe": "moe"}
# A state without these is reported as incomplete (the others may legitimately be absent early on).
_CORE_FIELDS = ("status", "step", "heartbeat")


def num(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, bool, text, NaN, infinite)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        v = float(value)
        return v if math.isfinite(v) else None
    return None


def _int(value: Any) -> int | None:
    v = num(value)
    return int(v) if v is not None and v.is_integer() else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _checkpoint(value: Any) -> dict | None:
    if not isinstance(value, dict):
        return None
    return {"step": _int(value.get("step")), "path": _str(value.get("path")), "time": num(value.get("time"))}


def _gpu(value: Any) -> dict | None:
    if not isinstance(value, dict):
        return None
    return {
        "name": _str(value.get("name")),
        "utilization": num(value.get("utilization")),
        "memory_used": num(value.get("memory_used")),
        "memory_total": num(value.get("memory_total")),
        "temperature": num(value.get("temperature")),
        "power_w": num(value.get("power_w")),
    }


def _alerts(value: Any) -> list[dict]:
    if not isinstance(value, list):
        return []
    out = []
    for a in value:
        if isinstance(a, dict):
            out.append(
                {
                    "time": num(a.get("time")),
                    "step": _int(a.get("step")),
                    "condition": _str(a.get("condition")),
                    "severity": _str(a.get("severity")),  # absent in records from before severities
                    "action": _str(a.get("action")),
                    "message": _str(a.get("message")),
                }
            )
    return out


def _events(value: Any) -> list[dict]:
    """Skipped bad steps and rollbacks: {"time", "step", "kind", "message", "rows"} (rows: how many
    data rows the event left out; the rows themselves are `apr runs ledger`'s)."""
    if not isinstance(value, list):
        return []
    out = []
    for e in value:
        if isinstance(e, dict):
            detail = e.get("detail") if isinstance(e.get("detail"), dict) else {}
            rows = detail.get("rows")
            # an orchestrated run's strategy from then on (apr/train/orchestrator.py's events)
            strategy = {"strategy": detail.get("strategy"), "switch": detail.get("to"),
                        "safety_rollback": detail.get("to"), "decision": detail.get("winner")}.get(e.get("kind"))
            out.append({"time": num(e.get("time")), "step": _int(e.get("step")), "kind": _str(e.get("kind")),
                        "message": _str(e.get("message")), "rows": len(rows) if isinstance(rows, list) else None,
                        "strategy": _str(strategy)})
    return out


def _drift(value: Any) -> dict | None:
    """The run against its plan (apr/train/drift.py): the figures the dashboard shows."""
    if not isinstance(value, dict):
        return None
    return {"step": _int(value.get("step")), "tokens_per_s": num(value.get("tokens_per_s")),
            "planned_tokens_per_s": num(value.get("planned_tokens_per_s")),
            "planned_from": _str(value.get("planned_from")),
            **{k: num(value.get(k)) for k in ("drift_step_time", "drift_tokens_per_s", "drift_memory")}}


def _mixture(value: Any) -> dict | None:
    """A data mixture's progress (apr/data/mixloader.py): stage, and per source tokens, rows,
    epochs and the last val loss."""
    if not isinstance(value, dict) or not isinstance(value.get("sources"), dict):
        return None
    sources = {str(name): {k: num(f.get(k)) for k in ("tokens", "rows", "epochs", "val_loss")}
               for name, f in value["sources"].items() if isinstance(f, dict)}
    return {"step": _int(value.get("step")), "stage": _int(value.get("stage")),
            "stage_name": _str(value.get("stage_name")), "sources": sources}


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _history(value: Any) -> tuple[tuple[int, float], ...]:
    """``[[step, value], ...]`` as a tuple of (int, float) pairs; malformed points are dropped."""
    if not isinstance(value, list):
        return ()
    points = []
    for p in value:
        if isinstance(p, (list, tuple)) and len(p) == 2:
            step, v = _int(p[0]), num(p[1])
            if step is not None and v is not None:
                points.append((step, v))
    return tuple(points)


def _evals(value: Any) -> dict | None:
    """In-training task scores: {task: {"step", "acc", "acc_norm"}} (docs/eval.md)."""
    if not isinstance(value, dict):
        return None
    out = {name: {k: num(score.get(k)) for k in ("step", "acc", "acc_norm")}
           for name, score in value.items() if isinstance(name, str) and isinstance(score, dict)}
    return out or None


def _samples(value: Any) -> dict | None:
    """The latest sample generations: {"step", "items": [{"prompt", "text"}]}."""
    if not isinstance(value, dict) or not isinstance(value.get("items"), list):
        return None
    items = [{"prompt": i["prompt"], "text": i["text"]} for i in value["items"]
             if isinstance(i, dict) and isinstance(i.get("prompt"), str) and isinstance(i.get("text"), str)]
    return {"step": num(value.get("step")), "items": items}


def _block_norms(value: Any) -> dict | None:
    """Per-block norms of the latest log step (monitoring.block_norms): the two lists as tuples of
    float | None (None: non-finite or malformed), the scalars as float | None."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {"step": _int(value.get("step"))}
    for key in ("block_grad_norm", "block_update_norm"):
        items = value.get(key)
        out[key] = tuple(num(x) for x in items) if isinstance(items, list) else ()
    for key in ("embed_grad_norm", "embed_update_norm", "head_grad_norm", "head_update_norm",
                "max_block_grad_norm", "max_block_update_norm"):
        out[key] = num(value.get(key))
    return out if out["block_grad_norm"] or out["block_update_norm"] else None


def _numbers(value: Any) -> dict | None:
    """A flat record of figures (data drift: {"step", "data_drift_psi", ...}): numbers only."""
    if not isinstance(value, dict):
        return None
    return {k: num(v) for k, v in value.items() if isinstance(k, str)} or None


def _moe(value: Any) -> dict | None:
    """A mixture of experts' latest routing figures (model.architecture.moe): {"step",
    "moe_balance_loss", "moe_expert_load": (share per expert, ...), "moe_max_expert_load"}."""
    if not isinstance(value, dict):
        return None
    load = value.get("moe_expert_load")
    return {"step": _int(value.get("step")), "moe_balance_loss": num(value.get("moe_balance_loss")),
            "moe_expert_load": tuple(num(x) for x in load) if isinstance(load, list) else None,
            "moe_max_expert_load": num(value.get("moe_max_expert_load"))}


def _histograms(value: Any) -> dict | None:
    """The latest per-layer histograms (monitoring.histograms): {"step", "bins", "layers": (layer, ...)},
    each layer {"name", "kind", "lo", "hi", "min", "max", "counts": (int, ...)}; malformed layers dropped."""
    if not isinstance(value, dict) or not isinstance(value.get("layers"), list):
        return None
    layers = tuple({"name": h["name"], "kind": h["kind"], "lo": num(h.get("lo")), "hi": num(h.get("hi")),
                    "min": num(h.get("min")), "max": num(h.get("max")),
                    "counts": tuple(max(0.0, num(c) or 0.0) for c in h["counts"])}
                   for h in value["layers"] if isinstance(h, dict) and isinstance(h.get("name"), str)
                   and h.get("kind") in ("weight", "grad") and isinstance(h.get("counts"), list) and h["counts"])
    return {"step": _int(value.get("step")), "bins": _int(value.get("bins")), "layers": layers} if layers else None


def _eval_history(value: Any) -> tuple[dict, ...]:
    """Each task evaluation's scores: ({"step", "stage", "scores": {task: acc}}, ...)."""
    if not isinstance(value, list):
        return ()
    return tuple({"step": _int(e.get("step")), "stage": _str(e.get("stage")),
                  "scores": {k: num(v) for k, v in e["scores"].items() if isinstance(k, str)}}
                 for e in value if isinstance(e, dict) and isinstance(e.get("scores"), dict))


def _cost(value: Any) -> dict | None:
    """The live cost (training.price_per_gpu_hour): {"price_per_gpu_hour", "gpus", "spent", "projected"}."""
    if not isinstance(value, dict) or num(value.get("spent")) is None:
        return None
    return {"price_per_gpu_hour": num(value.get("price_per_gpu_hour")), "gpus": _int(value.get("gpus")),
            "spent": num(value.get("spent")), "projected": num(value.get("projected"))}


_CONVERT = {
    "str": _str,
    "int": _int,
    "num": num,
    "checkpoint": _checkpoint,
    "gpu": _gpu,
    "alerts": _alerts,
    "events": _events,
    "drift": _drift,
    "mixture": _mixture,
    "strings": _strings,
    "evals": _evals,
    "samples": _samples,
    "block_norms": _block_norms,
    "cost": _cost,
    "numbers": _numbers,
    "histograms": _histograms,
    "eval_history": _eval_history,
    "moe": _moe,
}


def normalize(doc: dict) -> tuple[dict, tuple[str, ...]]:
    """Every known field of ``doc`` converted to its type (None when missing or of the wrong type),
    histories as tuples of (step, value); also the names of the schema's fields ``doc`` lacks."""
    state: dict[str, Any] = {"schema_version": doc.get("schema_version")}
    for key, kind in {**_FIELD_KINDS, **_OPTIONAL_FIELDS}.items():
        state[key] = _CONVERT[kind](doc.get(key))
    for key in HISTORY_KEYS:
        state[f"{key}_history"] = _history(doc.get(f"{key}_history"))
    if state["status"] is None:
        state["status"] = "unknown"
    missing = tuple(k for k in (*_FIELD_KINDS, *(f"{h}_history" for h in HISTORY_KEYS)) if k not in doc)
    return state, missing


@dataclass(frozen=True)
class Reading:
    """One look at the state file.

    kind: "ok" (``state`` is set), "missing" (no file yet), "unreadable" (permissions, a folder...),
    "malformed" (not JSON, not an object, no schema_version) or "unsupported" (a newer schema).
    ``problem`` is a one-line explanation for every kind but "ok"; ``missing_fields`` lists the
    schema's fields an "ok" state lacks.
    """

    kind: str
    path: Path
    state: dict | None = None
    problem: str | None = None
    missing_fields: tuple[str, ...] = field(default=())
    raw: dict | None = field(default=None, compare=False, repr=False)  # the document as written

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


def state_path(run_dir: str | os.PathLike) -> Path:
    """``run_dir/training_state.json``; a path naming a ``.json`` file is taken as the file itself."""
    p = Path(run_dir)
    return p if p.suffix == ".json" and not p.is_dir() else p / STATE_FILE


def parse_state(text: str | bytes, path: Path) -> Reading:
    """Turn the file's content into a `Reading` (never raises)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            return Reading("malformed", path, problem=f"{path.name} is not UTF-8 text")
    if not text.strip():
        return Reading("malformed", path, problem=f"{path.name} is empty (being written?)")
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        return Reading("malformed", path, problem=f"{path.name} is not valid JSON{where}: {msg}")
    if not isinstance(doc, dict):
        return Reading("malformed", path, problem=f"{path.name} is not a JSON object")

    if too_deep_at(doc) is not None:
        return Reading("malformed", path, problem=f"{path.name} nests more than {MAX_JSON_DEPTH} levels deep")
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return Reading(
            "malformed", path, problem=f"{path.name} has no valid schema_version (got {version!r})"
        )
    if version > SCHEMA_VERSION:
        return Reading(
            "unsupported",
            path,
            problem=f"{path.name} has schema_version {version}; this apr reads {SCHEMA_VERSION}: upgrade apr",
        )
    state, missing = normalize(doc)
    return Reading("ok", path, state=state, missing_fields=missing, raw=doc)


def read_once(run_dir: str | os.PathLike) -> Reading:
    """Read and parse a run's state file once (never raises)."""
    return read_file(state_path(run_dir))


def read_file(path: Path) -> Reading:
    """Read and parse one state file (never raises)."""

    try:
        if not os.path.lexists(path):
            raise FileNotFoundError(path)
        # bounded: a FIFO or device is refused without opening it (no hang), size capped
        data = read_bytes(path, "state", "state file", limit=MAX_STATE_BYTES)
    except InputError as e:
        return Reading("unreadable", path, problem=f"{path.name}: " + e.message.replace(f"state file {path} ", ""))
    except FileNotFoundError:
        # Problems name the file, not its (long) path: the dashboard's header and the JSON record
        # already say which run folder this is.
        if path.parent.is_dir():
            return Reading("missing", path, problem=f"{path.name} does not exist yet (the run has not started?)")
        return Reading("missing", path, problem="the run folder does not exist (yet)")
    except OSError as e:
        return Reading("unreadable", path, problem=f"cannot read {path.name}: {e.strerror or e}")
    return parse_state(data, path)


class StateReader:
    """Polls one run's state file, re-reading it only when it changed.

    ``reading`` is the latest look; ``state`` the latest good state (kept while the file is
    briefly missing or malformed, so a dashboard keeps showing something useful).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = state_path(run_dir)
        self.reading: Reading | None = None
        self.state: dict | None = None
        self.reads = 0  # how many times the file was actually read (for tests and benchmarks)
        self._signature: tuple | None = ("never",)

    def _stat_signature(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:
            return ("error", e.errno)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def poll(self) -> bool:
        """Look at the file; True when the reading differs from the previous one."""
        signature = self._stat_signature()
        if signature == self._signature and self.reading is not None:
            return False
        self._signature = signature
        self.reads += 1
        reading = read_file(self.path)
        changed = reading != self.reading
        self.reading = reading
        if reading.ok:
            self.state = reading.state
        return changed


def stale_threshold(refresh_s: float = 1.0, state: dict | None = None) -> float:
    """Seconds without a heartbeat after which an active run is shown as stale: at least
    STALE_FLOOR_S, 10 refresh periods, and 10 of the writer's own periods when it records one
    (a run that logs every 2 minutes is slow, not dead)."""
    period = num((state or {}).get("log_period_s")) or 0.0
    return max(STALE_FLOOR_S, 10.0 * refresh_s, 10.0 * period)


def heartbeat_age(state: dict, now: float) -> float | None:
    hb = num(state.get("heartbeat"))
    return None if hb is None else max(0.0, now - hb)


def trainer_gone(state: dict) -> bool:
    """An active run recorded on this host whose trainer process no longer runs (killed with
    SIGKILL, out of memory): certain, so there is no need to wait for the heartbeat to age."""
    return state.get("status") in ACTIVE_STATUSES and trainer_alive(
        state.get("host"), state.get("pid"), num(state.get("heartbeat"))) is False


def effective_status(state: dict, now: float, threshold_s: float) -> str:
    """The recorded status; "dead" for an active run of this host whose trainer process is gone;
    "stale" for an active run whose heartbeat is too old."""
    status = state.get("status") or "unknown"
    if status in ACTIVE_STATUSES:
        if trainer_gone(state):
            return "dead"
        age = heartbeat_age(state, now)
        if age is not None and age > threshold_s:
            return "stale"
    return status
