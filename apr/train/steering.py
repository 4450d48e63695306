"""The loop's side of ``apr train steer`` (apr/steer.py; docs/training.md, "Steering a live run").

Between steps, rank 0 reads new requests from ``RUN_DIR/steer/`` in the order written (under DDP it
sends them to every rank), and the loop applies them before the next step on every rank: the LR
factor, the clipping threshold, the log / eval / save intervals, a step to stop at, a checkpoint or
a validation after the next step. Each applied request is recorded as a ``steer`` event, moved to
``steer/applied/`` with the step it took effect at, and kept in every checkpoint (``steering``): a
resume re-applies the checkpoint's requests, and replays at their own steps the ones an earlier
process applied after that checkpoint, so the resumed run ends where the uninterrupted one does. A
malformed request is reported (a warning and a ``steer_rejected`` event) and ignored; it never stops
the run.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from apr.errors import AprError
from apr.fsutil import atomic_write_json
from apr.readers import load_json
from apr.steer import APPLIED_DIR, STEER_DIR, parse_value


class Steering:
    def __init__(self, run_dir: Path):
        self.folder = Path(run_dir) / STEER_DIR
        self.applied: list[dict] = []  # {"number", "step", "changes"}: every request applied, in order
        self.lr_factor = 1.0
        self.grad_clip: float | None = None  # None: the config's
        self.intervals: dict[str, int] = {}  # training.*_interval -> value
        self.stop_at: int | None = None
        self.checkpoint_at: int | None = None  # one-shot: a checkpoint after this step
        self.evaluate_at: int | None = None  # one-shot: a validation after this step
        self._replay: list[dict] = []  # applied by an earlier process after the checkpoint resumed from

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"steering": {"applied": [dict(a) for a in self.applied]}}

    def load_state_dict(self, meta: dict, start_step: int) -> None:
        """The checkpoint's requests, in force again; the ones applied after it wait for their step."""
        self.applied = [dict(a) for a in ((meta or {}).get("steering") or {}).get("applied") or []]
        for entry in self.applied:
            self._set(entry["changes"], entry["step"], one_shots=False)
        known = {int(a["number"]) for a in self.applied}
        later = []
        for path in sorted((self.folder / APPLIED_DIR).glob("*.json")) if (self.folder / APPLIED_DIR).is_dir() else []:
            try:
                doc = load_json(path, "steer", "steer record")
            except AprError:
                continue
            if isinstance(doc, dict) and doc.get("number") not in known and int(doc.get("step", -1)) > start_step:
                later.append({"number": int(doc["number"]), "step": int(doc["step"]), "changes": doc["changes"]})
        self._replay = sorted(later, key=lambda e: (e["step"], e["number"]))

    # ------------------------------------------------------------------ between steps

    def due(self, run, step: int) -> list[dict]:
        """Rank 0's requests to apply before ``step`` (replays of that step, then new files), the same
        list on every rank."""
        found: list[dict] = []
        if run.is_main:
            found = [e for e in self._replay if e["step"] == step]
            self._replay = [e for e in self._replay if e["step"] != step]
            if not found:  # a replayed step takes exactly what was applied there, nothing new
                found = self._new_requests(run, step)
        if run.dp is not None and run.dp.any_host([len(found)])[0]:  # three ints a step; the list only when due
            found = run.dp.broadcast_host(found)
        return found

    def _new_requests(self, run, step: int) -> list[dict]:
        try:
            names = sorted(n for n in os.listdir(self.folder) if n.endswith(".json") and n.split("-")[0].isdigit())
        except OSError:
            return []
        out, applied = [], {int(a["number"]) for a in self.applied}
        for name in names:
            path = self.folder / name
            if int(name.split("-")[0]) in applied:  # applied already; its file could not be moved
                continue
            try:
                doc = load_json(path, "steer", "steer request")
                if not isinstance(doc, dict) or not isinstance(doc.get("changes"), dict) or not doc["changes"]:
                    raise ValueError("expected {\"changes\": {KEY: VALUE, ...}}")
                changes = {str(k): parse_value(str(k), str(v)) for k, v in doc["changes"].items()}
                self._check(run, changes, step)
            except (AprError, ValueError) as err:
                reason = err.message if isinstance(err, AprError) else str(err)
                self._reject(run, path, step, reason)
                continue
            out.append({"number": int(name.split("-")[0]), "step": step, "changes": changes, "path": str(path)})
        return out

    def _check(self, run, changes: dict, step: int) -> None:
        if "training.grad_clip" in changes and run.engine.strategy.clip == "off":
            raise ValueError("training.grad_clip: this run does not clip (its step strategy was planned without "
                             "clipping); steer a run that clips")
        if changes.get("training.eval_interval") and not run.validation.configured:
            raise ValueError("training.eval_interval: this run has no validation set")
        if "stop_at" in changes and changes["stop_at"] < step:
            raise ValueError(f"stop_at {changes['stop_at']}: step {step - 1} is done already")

    def _reject(self, run, path: Path, step: int, reason: str) -> None:
        run.warn(f"steer request {path.name} ignored: {reason}")
        run.recorder.log_event("steer_rejected", step, f"steer request {path.name} ignored: {reason}",
                               {"file": path.name, "reason": reason})
        self._move(path, path.name.removesuffix(".json") + ".rejected")

    def apply(self, run, entries: list[dict], recorder) -> None:
        """Carry out the due requests before their step, record them, and move their files to applied/."""
        for entry in entries:
            step, changes = entry["step"], entry["changes"]
            self._set(changes, step, one_shots=True)
            if "training.grad_clip" in changes:
                run.engine.grad_clip = self.grad_clip
            run.cadence = replace(run.cadence, **{k.split(".")[1]: v for k, v in self.intervals.items()})
            record = {"number": entry["number"], "step": step, "changes": changes}
            self.applied.append(record)
            shown = ", ".join(f"{k}={v}" for k, v in changes.items())
            run.echo(f"{run.step_label(step)}  steer: {shown}")
            recorder.log_event("steer", step, f"steer: {shown}", record)
            if run.is_main and entry.get("path"):
                self._move(Path(entry["path"]), Path(entry["path"]).name, record)

    def _set(self, changes: dict, step: int, one_shots: bool) -> None:
        for key, value in changes.items():
            if key == "lr_factor":
                self.lr_factor = float(value)
            elif key == "training.grad_clip":
                self.grad_clip = float(value)
            elif key.endswith("_interval"):
                self.intervals[key] = int(value)
            elif key == "stop_at":
                self.stop_at = int(value)
            elif key == "checkpoint" and one_shots:
                self.checkpoint_at = step
            elif key == "evaluate" and one_shots:
                self.evaluate_at = step

    def restore(self, run) -> None:
        """After a resume: the checkpoint's clipping threshold and intervals in force again."""
        if self.grad_clip is not None:
            run.engine.grad_clip = self.grad_clip
        if self.intervals:
            run.cadence = replace(run.cadence, **{k.split(".")[1]: v for k, v in self.intervals.items()})

    def _move(self, path: Path, name: str, record: dict | None = None) -> None:
        done = self.folder / APPLIED_DIR
        try:
            done.mkdir(exist_ok=True)
            if record is not None:  # what was applied and at which step: a resume replays it from here
                atomic_write_json(done / name, record)
                path.unlink(missing_ok=True)
            else:
                os.replace(path, done / name)
        except OSError:
            pass  # a read-only folder: the request stays; the checkpoint still holds what was applied
