"""`apr monitor --json`: the run's state as one JSON object, or one JSON line per change.

Every object has the same shape (``format_version`` "1")::

    {"format_version": "1", "run_dir": "...", "status": "running" | "stale" | ... | null,
     "stale": false, "heartbeat_age_s": 1.2, "stale_after_s": 30.0,
     "problem": null | {"kind": "missing" | "unreadable" | "malformed" | "unsupported", "message": "..."},
     "missing_fields": [], "state": {... training_state.json as written ...} | null,
     "forecast": null | {"step", "loss", "low", "high", "floor", "scale", "alpha", "points", "last_step"}}

``status`` is the recorded status, "dead" when an active run of this host has lost its trainer
process, or "stale" when an active run's heartbeat is older than ``stale_after_s``; it is null
exactly when ``state`` is null (then ``problem`` says why). ``forecast`` is the final validation loss
forecast from the state's validations (apr/monitor/view.py ``forecast_view``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from apr.errors import AprError, Finding
from apr.monitor.state import (
    ENDED_STATUSES,
    Reading,
    StateReader,
    effective_status,
    heartbeat_age,
    read_once,
    stale_threshold,
)
from apr.monitor.view import forecast_view

FORMAT_VERSION = "1"


def monitor_record(
    reading: Reading, run_dir: str | Path, now: float, refresh_s: float = 1.0, include_history: bool = True
) -> dict:
    """The JSON object for one reading of a run's state file."""
    state = reading.state if reading.ok else None
    stale_after = stale_threshold(refresh_s, state)
    raw = None
    status = None
    age = None
    if state is not None:
        raw = dict(reading.raw or {})
        if not include_history:
            raw = {k: v for k, v in raw.items() if not k.endswith("_history")}
        status = effective_status(state, now, stale_after)
        age = heartbeat_age(state, now)
    return {
        "format_version": FORMAT_VERSION,
        "run_dir": str(run_dir),
        "status": status,
        "stale": status == "stale",
        "heartbeat_age_s": None if age is None else round(age, 3),
        "stale_after_s": stale_after,
        "problem": None if reading.ok else {"kind": reading.kind, "message": reading.problem},
        "missing_fields": list(reading.missing_fields),
        "state": raw,
        "forecast": forecast_view(state),
    }


def snapshot(
    run_dir: str | Path, now: float | None = None, refresh_s: float = 1.0, include_history: bool = True
) -> dict:
    """The current record of ``run_dir``. Raises AprError when there is no readable state."""
    reading = read_once(run_dir)
    if not reading.ok:
        raise AprError(
            f"{run_dir}: {reading.problem or 'no state'}",
            [
                Finding(
                    "error", f"monitor.state_{reading.kind}", reading.problem or "", file=str(reading.path)
                )
            ],
        )
    return monitor_record(reading, run_dir, time.time() if now is None else now, refresh_s, include_history)


def follow(
    run_dir: str | Path,
    emit: Callable[[dict], None],
    interval_s: float = 1.0,
    timeout_s: float | None = None,
    include_history: bool = True,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, dict]:
    """Emit a record now and after every change (new file content, or the run turning stale)
    until the run ends ("ended") or ``timeout_s`` passes ("timeout"). Waits for a missing file.
    Returns the reason and the last record."""
    reader = StateReader(run_dir)
    start = clock()
    last_key: tuple | None = None
    record: dict = {}
    while True:
        reader.poll()
        now = clock()
        assert reader.reading is not None
        reading = reader.reading
        status = None
        if reading.ok:
            status = effective_status(reading.state, now, stale_threshold(interval_s, reading.state))
        key = (reading, status)
        if key != last_key:
            record = monitor_record(reading, run_dir, now, interval_s, include_history)
            emit(record)
            last_key = key
        if status in ENDED_STATUSES:
            return "ended", record
        if timeout_s is not None and now - start >= timeout_s:
            return "timeout", record
        wait = interval_s if timeout_s is None else max(0.0, min(interval_s, start + timeout_s - now))
        sleep(wait)
