"""``apr train fork RUN_DIR --at STEP [KEY=VALUE...]``: a new run from a run's checkpoint at STEP with
the given overrides (a WSD cooldown tail, another lr, another data stage), planned like any apply
(docs/design.md, "Decisions": a run is its resolved plan plus its recorded events).

The parent's resolved config (``RUN_DIR/config.yaml``) with the overrides is planned (a fork the plan
refuses never starts), then applied as a resume of the checkpoint into a new output folder, under a
new run id. The new run records where it came from as a ``fork`` event (both stores and its
``training_state.json``): ``apr runs show --json`` has ``parent: {run_id, step}``. A fork with no
overrides continues exactly as the parent did. A layer above ``apr.train``, like ``apr.apply``.
"""

from __future__ import annotations

import os
from pathlib import Path

from apr.apply import run_apply
from apr.checkpoint.manager import read_info, scan
from apr.errors import AprError, Finding
from apr.train.outdir import RESOLVED_CONFIG


def _error(code: str, message: str, **kw) -> AprError:
    return AprError(message, [Finding("error", code, message, **kw)])


def fork_checkpoint(run_dir: Path, at: int) -> tuple[Path, str | None]:
    """The complete checkpoint of ``run_dir`` at step ``at`` and the run id that wrote it; refused,
    listing the steps there are, when there is none."""
    entries = [e for e in scan(run_dir) if e.complete]
    found = next((e for e in entries if e.step == at), None)
    if found is None:
        there = ", ".join(str(e.step) for e in sorted(entries, key=lambda e: e.step)) or "none"
        raise _error("fork.no_checkpoint", f"{run_dir} has no checkpoint at step {at}; checkpoints there: {there}",
                     path="--at", file=str(run_dir), expected=f"a step among: {there}", got=str(at))
    run_id = read_info(found.json_path).doc.get("run_id")
    return found.json_path, run_id if isinstance(run_id, str) else None


def default_fork_dir(run_dir: Path, at: int) -> Path:
    """A new folder beside the parent's: ``<parent>-fork-<step>``, numbered when that exists."""
    base = run_dir.parent / f"{run_dir.name}-fork-{at}"
    candidate, n = base, 2
    while os.path.lexists(candidate):
        candidate = base.with_name(f"{base.name}-{n}")
        n += 1
    return candidate


def _refuse_folder(out: Path, run_dir: Path) -> None:
    """A fork writes only into a new or empty folder, never the parent's or another run's."""
    if out.resolve() == run_dir.resolve():
        raise _error("fork.output_dir", f"a fork never writes into its parent's folder ({run_dir})",
                     path="--out", expected="a new folder", got=str(out))
    if os.path.lexists(out) and (not out.is_dir() or any(out.iterdir())):
        raise _error("fork.output_dir", f"{out} already exists and is not an empty folder; a fork starts a new run "
                     "folder and touches nothing there", path="--out", file=str(out),
                     expected="a new or empty folder", got="an existing file or folder with contents")


def run_fork(run_dir: Path, *, at: int, settings: list[str] | None = None, out: Path | None = None,
             gpu: str | None = None, vram: str | None = None, apr_home: Path | None = None, echo=None,
             progress=None, handle_signals: bool = True):
    """Plan and run the fork; returns ``apr.train.run.RunResult``. Raises AprError for anything a user
    can fix, before anything is written."""
    run_dir = Path(os.path.abspath(os.path.expanduser(run_dir)))
    config_path = run_dir / RESOLVED_CONFIG
    if out is not None:  # a bad --out is refused before anything else is read
        out = Path(os.path.abspath(os.path.expanduser(out)))
        _refuse_folder(out, run_dir)
    if not config_path.is_file():
        raise _error("fork.no_run", f"{run_dir} is not an apr run folder (no {RESOLVED_CONFIG})", file=str(run_dir),
                     expected=f"a run folder holding {RESOLVED_CONFIG} and checkpoints", got="no config.yaml")
    checkpoint, parent_id = fork_checkpoint(run_dir, at)
    if out is None:
        out = default_fork_dir(run_dir, at)
    if any(s.split("=", 1)[0].strip() == "training.output_dir" for s in settings or []):
        raise _error("fork.usage", "a fork's folder is --out, not training.output_dir", path="training.output_dir",
                     file="command line", expected="--out DIR", got="training.output_dir=...")
    # the overrides change the run's course on purpose: the resume takes them as --force would (a change
    # no resume can take, another model, is still refused)
    return run_apply(config_path, resume=str(checkpoint), settings=[*(settings or []), f"training.output_dir={out}"],
                     force=bool(settings), gpu=gpu, vram=vram, apr_home=apr_home, echo=echo, progress=progress,
                     handle_signals=handle_signals, fork_of={"run_id": parent_id, "step": int(at),
                                                             "run_dir": str(run_dir)})
