"""Active runs, found through the global registry `$APR_HOME/experiments.db` (table `runs`).

The registry says where each run writes (`output_dir`); the run's own `training_state.json` says
whether it is alive (an active status and a fresh heartbeat). The registry is opened read-only and
everything about it may be missing: the file, the table, a column; then there are no runs, and
`notes` says why.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from apr.fmt import fmt_duration, fmt_int
from apr.monitor.state import ACTIVE_STATUSES, heartbeat_age, read_once, stale_threshold, trainer_gone

MAX_CANDIDATES = 500  # registry rows looked at (newest first); each costs one small file read


def registry_path() -> Path:
    """``$APR_HOME/experiments.db``, default ``~/.apr/experiments.db``."""
    home = os.environ.get("APR_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".apr") / "experiments.db"


@dataclass(frozen=True)
class ActiveRun:
    run_id: str
    experiment: str
    output_dir: str
    status: str
    step: int | None = None
    total_steps: int | None = None
    heartbeat_age_s: float | None = None

    def describe(self) -> str:
        total = f"/{fmt_int(self.total_steps)}" if self.total_steps else ""
        age = (
            f", heartbeat {fmt_duration(self.heartbeat_age_s)} ago"
            if self.heartbeat_age_s is not None
            else ""
        )
        return (
            f"{self.experiment} · {self.run_id} · step {fmt_int(self.step)}{total}{age} · {self.output_dir}"
        )

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "experiment": self.experiment,
            "output_dir": self.output_dir,
            "status": self.status,
            "step": self.step,
            "total_steps": self.total_steps,
            "heartbeat_age_s": self.heartbeat_age_s,
        }


@dataclass
class Discovery:
    runs: list[ActiveRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    registry: Path | None = None


def _registry_rows(db: Path, notes: list[str]) -> list[dict]:
    if not db.is_file():
        notes.append(f"no registry at {db} (no run has been recorded on this machine)")
        return []
    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error as e:
        notes.append(f"cannot open {db}: {e}")
        return []
    try:
        conn.row_factory = sqlite3.Row
        columns = {row["name"] for row in conn.execute("PRAGMA table_info(runs)")}
        if not columns:
            notes.append(f"{db} has no runs table")
            return []
        if "output_dir" not in columns:
            notes.append(f"{db}: table runs has no output_dir column")
            return []
        where, args = "", []
        if "status" in columns:
            where = f" WHERE status IN ({','.join('?' * len(ACTIVE_STATUSES))})"
            args = list(ACTIVE_STATUSES)
        order = " ORDER BY started DESC" if "started" in columns else ""
        rows = conn.execute(f"SELECT * FROM runs{where}{order} LIMIT {MAX_CANDIDATES}", args).fetchall()
        return [dict(r) for r in rows]
    except sqlite3.Error as e:
        notes.append(f"cannot read {db}: {e}")
        return []
    finally:
        conn.close()


def find_active_runs(
    db: str | os.PathLike | None = None, now: float | None = None, refresh_s: float = 1.0
) -> Discovery:
    """Runs the registry lists as starting/running whose state file has a fresh heartbeat,
    newest first, one per output directory. Never raises."""
    path = Path(db) if db is not None else registry_path()
    now = time.time() if now is None else now
    found = Discovery(registry=path)
    seen: set[str] = set()
    for row in _registry_rows(path, found.notes):
        out = row.get("output_dir")
        if not isinstance(out, str) or not out:
            continue
        key = os.path.realpath(out)
        if key in seen:
            continue
        seen.add(key)
        reading = read_once(out)
        if not reading.ok:
            continue
        state = reading.state
        if state["status"] not in ACTIVE_STATUSES or trainer_gone(state):
            continue
        age = heartbeat_age(state, now)
        if age is None or age > stale_threshold(refresh_s, state):
            continue
        found.runs.append(
            ActiveRun(
                run_id=state.get("run_id") or str(row.get("id") or "?"),
                experiment=state.get("experiment") or str(row.get("experiment") or "?"),
                output_dir=out,
                status=state["status"],
                step=state.get("step"),
                total_steps=state.get("total_steps"),
                heartbeat_age_s=round(age, 1),
            )
        )
    return found
