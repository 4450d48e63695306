"""``apr train steer RUN_DIR KEY=VALUE...``: change a live run at its next step boundary, for the keys
that can change without giving up exactness (docs/training.md, "Steering a live run").

A request is a file in the run's folder (``steer/NNNNNN-<time>.json``, written atomically, so it
works over SSH and needs no server); the run's loop reads new requests between steps, in the order
written, applies them on every rank at the same step, and records each as a ``steer`` event (both
stores) and in its checkpoints, so a resume replays it at the same step. Torch-free: the request
side and the key rules; the loop's side is apr/train/steering.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from apr.errors import AprError, Finding
from apr.fsutil import atomic_write_json

STEER_DIR = "steer"  # beside the run's checkpoints: requests waiting, and applied/ (what was applied, when)
APPLIED_DIR = "applied"

# key -> (kind, what it changes); every value is checked by ``parse_value``
STEERABLE: dict[str, tuple[str, str]] = {
    "lr_factor": ("positive", "multiplies the schedule's learning rate from the next step on"),
    "training.grad_clip": ("positive", "the clipping threshold (a run that clips; its mode is unchanged)"),
    "training.log_interval": ("count", "steps between logged steps"),
    "training.eval_interval": ("count0", "steps between validations (0: none)"),
    "training.save_interval": ("count", "steps between checkpoints"),
    "stop_at": ("count", "stop after this step, with a checkpoint"),
    "checkpoint": ("true", "write a checkpoint after the next step"),
    "evaluate": ("true", "validate after the next step"),
}


def _refuse(message: str, key: str, expected: str, got: str) -> AprError:
    return AprError(message, [Finding("error", "steer.key", message, path=key, file="command line",
                                      expected=expected, got=got[:80])])


def parse_value(key: str, text: str):
    """The value of a steerable ``key`` from its text; AprError naming the key when it is not."""
    if key not in STEERABLE:
        raise _refuse(f"{key} cannot be steered in a live run; steerable keys: {', '.join(STEERABLE)}", key,
                      "one of: " + ", ".join(STEERABLE), key)
    kind = STEERABLE[key][0]
    try:
        if kind == "true":
            if text.strip().lower() not in ("true", "1", "yes"):
                raise ValueError
            return True
        if kind == "positive":
            value = float(text)
            if not (value > 0 and value < float("inf")):
                raise ValueError
            return value
        value = int(text)
        if value < (0 if kind == "count0" else 1) or value > 10**12:
            raise ValueError
        return value
    except ValueError:
        expected = {"true": "true", "positive": "a finite number > 0", "count": "a whole number >= 1",
                    "count0": "a whole number >= 0"}[kind]
        raise _refuse(f"{key}: expected {expected}, got {text[:40]!r}", key, expected, text) from None


def parse_settings(settings: list[str]) -> dict:
    """``KEY=VALUE`` strings as a steer request's changes, every key checked."""
    if not settings:
        raise _refuse("no change given: apr train steer RUN_DIR KEY=VALUE...", "KEY=VALUE",
                      "one of: " + ", ".join(STEERABLE), "nothing")
    changes = {}
    for item in settings:
        key, sep, text = item.partition("=")
        if not sep:
            raise _refuse(f"{item[:60]!r} is not KEY=VALUE", item[:60], "KEY=VALUE", item)
        changes[key.strip()] = parse_value(key.strip(), text.strip())
    return changes


def request_steer(run_dir: Path, settings: list[str]) -> Path:
    """Write a steer request into ``run_dir``; its path. The run applies it at its next step boundary."""
    run_dir = Path(os.path.abspath(os.path.expanduser(run_dir)))
    if not any((run_dir / name).is_file() for name in ("training_state.json", "config.yaml")):
        raise AprError(f"{run_dir} is not a run folder (no training_state.json or config.yaml)", [Finding(
            "error", "steer.no_run", "not a run folder", file=str(run_dir),
            expected="the output folder of a run", got="no training_state.json or config.yaml")])
    changes = parse_settings(settings)
    folder = run_dir / STEER_DIR
    folder.mkdir(exist_ok=True)
    taken = [int(p.name.split("-")[0]) for p in folder.glob("*.json") if p.name.split("-")[0].isdigit()]
    applied = folder / APPLIED_DIR
    if applied.is_dir():
        taken += [int(p.name.split("-")[0]) for p in applied.glob("*.json") if p.name.split("-")[0].isdigit()]
    number = max(taken, default=0) + 1
    path = folder / f"{number:06d}-{int(time.time())}.json"
    atomic_write_json(path, {"changes": changes, "requested_at": time.time()})
    return path
