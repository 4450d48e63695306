"""Saving, pruning, verifying and loading checkpoints.

A checkpoint is a pair in the run directory:

    checkpoint-step-N.safetensors   weights (Hugging Face Llama names) + "optimizer.m.<name>" /
                                    "optimizer.v.<name>", float32
    checkpoint-step-N.json          step, is_best, SHA-256 and size of the weights file, the resolved
                                    config and its hash, apr version, format version, and the trainer's
                                    state (epoch, data cursor, RNG states, loss scaler, ...) at top level

Both are written to temp names in the same folder, fsynced and renamed; the JSON last. A sharded run
writes one weights file per rank instead (``checkpoint-step-N.part-R-of-K.safetensors``, format
version 2; apr/checkpoint/parts.py), named with their digests by the JSON, still written last. A pair
without its JSON is incomplete and ignored, so a crash at any moment leaves either the previous
checkpoints or the new one, never a file that looks complete and is not. Loading reads only
safetensors and JSON (nothing is unpickled), checks the size and SHA-256 of the weights, and checks
that the tensors are exactly the parameters (and AdamW state) of the config's model.
"""

from __future__ import annotations

import datetime as _dt
import errno
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr import __version__
from apr.checkpoint import files, parts, sidecar
from apr.checkpoint.background import BackgroundWriter, snapshot
from apr.checkpoint.files import read_safetensors_header
from apr.checkpoint.names import (
    expected_tensors,
    is_optimizer_state,
    loss_state_shapes,
    stage_tensors,
    stored_dtype,
    tensor_mismatches,
    torch_mismatches,
)
from apr.config.loader import config_doc_hash
from apr.config.schema import Architecture, LoraConfig, StackingConfig
from apr.errors import AprError, Finding
from apr.fmt import format_bytes as fmt_bytes
from apr.fsutil import atomic_write_json, fsync_dir
from apr.model.spec import DTYPE_BYTES
from apr.readers import InputError, check_regular, load_json
from apr.steps import stacking

FORMAT = "apr-checkpoint"
FORMAT_VERSION = 1
PARTS_FORMAT_VERSION = 2  # the weights in one part per rank (``weights_parts``)

# Keys the manager writes into the JSON; the trainer's meta sits beside them and may not reuse them.
RESERVED_KEYS = frozenset({
    "format", "format_version", "apr_version", "saved_at", "step", "is_best", "weights_file",
    "weights_sha256", "weights_size", "tensor_count", "config_hash", "config", "cwd", "weights_parts",
})
_REQUIRED_KEYS = ("format_version", "step", "weights_file", "weights_sha256", "weights_size", "config")

# Reasons a checkpoint is unusable that `load("latest")` skips past to the previous one. A checkpoint
# that is intact but belongs to a different model than the config is not skipped: resuming from an
# older one would be just as wrong, so that is refused outright.
FALLBACK_REASONS = frozenset({
    "unreadable", "not_apr", "unsupported_version", "missing_weights", "truncated", "size_mismatch",
    "sha_mismatch", "bad_weights", "foreign", "bad_meta", "edited",
})

log = logging.getLogger("apr.checkpoint")

# Errors that mean "no room to write" rather than a bug: reported as such, with the space needed.
_DISK_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EROFS: "the file system is read-only",
                errno.EFBIG: "the file would exceed the largest file the file system or a limit allows"}
_JSON_ALLOWANCE = 1 << 20  # the JSON sidecar and the safetensors header, generously


def _weights_metadata(step: int) -> dict[str, str]:
    return {"format": FORMAT, "step": str(step)}


def weights_file_bytes(config: Any, step: int, loss_tensors: dict | None = None) -> int:
    """The exact size of ``checkpoint-step-N.safetensors`` for this config (AprConfig or stored
    dict) at ``step``: every expected tensor as float32 plus the header; ``loss_tensors``: a loss
    part's own tensors as its JSON lists them (``names.loss_state_shapes``). Torch-free (the plan's
    storage estimate, docs/plan.md)."""
    dtype = stored_dtype(config)
    code, size = files.ST_DTYPE_CODES[dtype], DTYPE_BYTES[dtype]
    entries = [(name, code, shape, size * math.prod(shape)) for name, shape in
               sorted((_expected(config, step) | loss_state_shapes({"loss_tensors": loss_tensors})).items())]
    return files.safetensors_size(entries, _weights_metadata(step))


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _disk_error(err: OSError, path: Path, needed: int, free: int | None, what: str | None = None) -> CheckpointError:

    what = what or _DISK_ERRNOS.get(err.errno, err.strerror or str(err))
    space = f"a checkpoint needs about {fmt_bytes(needed)}" + (f", {fmt_bytes(free)} is free in {path.parent}"
                                                              if free is not None else "")
    message = (f"cannot write {path}: {what} ({space}); the previous checkpoints are intact; free some "
               "space (or lower training.keep_last) and resume with --resume latest")
    return CheckpointError(message, path, "disk_full", expected=f"{fmt_bytes(needed)} free",
                           got=f"{fmt_bytes(free)} free" if free is not None else what)


class CheckpointError(AprError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, foreign or for another model."""

    def __init__(self, message: str, path: Path | str | None = None, reason: str = "invalid",
                 expected: str | None = None, got: str | None = None,
                 findings: list[Finding] | None = None):
        if findings is None:
            findings = [Finding("error", f"checkpoint.{reason}", message,
                                file=str(path) if path else None, expected=expected, got=got)]
        super().__init__(message, findings)
        self.path = Path(path) if path else None
        self.reason = reason


@dataclass
class CheckpointInfo:
    """What a checkpoint's JSON says about it (filled in by loading)."""

    json_path: Path
    weights_path: Path
    step: int
    is_best: bool
    config: dict
    config_hash: str | None
    apr_version: str | None
    saved_at: str | None
    cwd: str | None  # working directory of the run that saved it (relative config paths start here)
    doc: dict = field(repr=False)
    parts: list[Path] = field(default_factory=list)  # a sharded run's per-rank weights files, in rank order

    @property
    def weights_files(self) -> list[Path]:
        return self.parts or [self.weights_path]


@dataclass
class TrainState:
    """Everything a run needs to continue exactly: the step just completed, the tensors (weights under
    Hugging Face Llama names plus ``optimizer.m.<name>`` / ``optimizer.v.<name>``, float32, on any
    device) and the trainer's JSON-serialisable state (epoch, data cursor, RNG, loss scaler, ...)."""

    step: int
    tensors: dict[str, Any]
    meta: dict = field(default_factory=dict)
    info: CheckpointInfo | None = None  # set by loading: where this state came from


# ------------------------------------------------------------------------------- model checks


def _architecture(config: Any, step: int | None = None):
    """The Architecture of an AprConfig or of a config dict (as stored in a checkpoint's JSON); with
    progressive stacking (model.stacking) and a ``step``, the depth a checkpoint of that step has."""

    if isinstance(config, Mapping):
        if step is not None:
            return stacking.stored_arch_at(config["model"], step)
        return Architecture.model_validate(config["model"]["architecture"])
    return config.model.architecture if step is None else stacking.arch_at(config, step)


def _expected(config: Any, step: int | None = None) -> dict:
    """The tensors a checkpoint of this config (AprConfig or stored dict) at ``step`` holds: the
    model (at that step's stacking depth), or only its LoRA adapters."""

    lora = config["model"].get("lora") if isinstance(config, Mapping) else config.model.lora
    if isinstance(lora, Mapping):
        lora = LoraConfig.model_validate(lora)
    stacked = config["model"].get("stacking") if isinstance(config, Mapping) else config.model.stacking
    if step is not None and stacked and stacking.trunk_transformed(StackingConfig.model_validate(stacked)
                                                                   if isinstance(stacked, Mapping) else stacked):
        staged = stacking.stored_config_at(config, step) if isinstance(config, Mapping) else \
            stacking.config_at(config, step)
        return stage_tensors(staged)
    return expected_tensors(_architecture(config, step), lora)


# ------------------------------------------------------------------------------------ reading


def _json_for(path: Path) -> Path:
    m = parts.PART_RE.match(path.name)
    if m:  # one rank's part of a sharded checkpoint: its JSON is the step's
        return path.with_name(f"{m.group(1)}.json")
    if path.suffix == ".safetensors":
        return path.with_suffix(".json")
    return path


def read_info(json_path: str | os.PathLike) -> CheckpointInfo:
    """Parse and sanity-check a checkpoint's JSON (no tensors are read)."""

    json_path = Path(json_path)
    try:  # bounded: a FIFO, device, huge or deeply nested file is refused, never read (docs/design.md)
        doc = load_json(json_path, "checkpoint", "checkpoint")
    except InputError as err:
        f = err.findings[0]
        if f.code == "file.missing":
            raise CheckpointError(f"{json_path.name} does not exist", json_path, "missing") from None
        raise CheckpointError(f"{json_path.name} is not readable JSON: {f.message}", json_path, "unreadable",
                              expected=f.expected, got=f.got) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"{json_path.name} is not an apr checkpoint", json_path, "not_apr",
                              expected=f"format {FORMAT!r}", got=repr(got))
    if doc.get("format_version") not in (FORMAT_VERSION, PARTS_FORMAT_VERSION):
        raise CheckpointError(
            f"{json_path.name} has checkpoint format version {doc.get('format_version')!r}; this apr "
            f"reads versions {FORMAT_VERSION} and {PARTS_FORMAT_VERSION}", json_path, "unsupported_version",
            expected=f"{FORMAT_VERSION} or {PARTS_FORMAT_VERSION}", got=repr(doc.get("format_version")))
    missing = [k for k in _REQUIRED_KEYS if k not in doc]
    if missing:
        raise CheckpointError(f"{json_path.name} lacks {', '.join(missing)}", json_path, "not_apr")
    try:
        head = sidecar.check_head(json_path.name, doc)
    except sidecar.SidecarProblem as err:
        raise CheckpointError(str(err), json_path, err.reason) from None
    weights_file = head.weights_file
    m = files.STEP_JSON_RE.match(json_path.name)
    if m and int(m.group(1)) != head.step:
        raise CheckpointError(f"{json_path.name} says step {doc['step']}", json_path, "foreign",
                              expected=f"step {m.group(1)}", got=f"step {doc['step']}")
    stem = files.step_stem(head.step) if m else (files.BEST_STEM if json_path.stem == files.BEST_STEM else None)
    if stem is not None and not weights_file.startswith(f"{stem}."):  # another step's (or run's) weights
        raise CheckpointError(f"{json_path.name} names the weights {weights_file}, not its own {stem}.safetensors "
                              "(the JSON was edited)", json_path, "edited", expected=f"{stem}.safetensors",
                              got=weights_file)
    part_paths = _part_paths(json_path, doc)
    return CheckpointInfo(
        parts=part_paths,
        json_path=json_path,
        weights_path=json_path.parent / weights_file,
        step=head.step,
        is_best=head.is_best,
        config=head.config,
        config_hash=head.config_hash,
        apr_version=head.apr_version,
        saved_at=head.saved_at,
        cwd=head.cwd,
        doc=doc,
    )


def _part_paths(json_path: Path, doc: dict) -> list[Path]:
    """The per-rank weights files a version-2 JSON names (``weights_parts``), checked for shape."""
    if doc.get("format_version") != PARTS_FORMAT_VERSION:
        return []
    entries = doc.get("weights_parts")
    ok = isinstance(entries, list) and entries and all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and parts.PART_RE.match(e["file"])
        and isinstance(e.get("sha256"), str) and isinstance(e.get("size"), int) and not isinstance(e["size"], bool)
        for e in entries)
    if not ok:
        raise CheckpointError(f"{json_path.name}: weights_parts is not a list of {{file, sha256, size}} naming "
                              "checkpoint part files", json_path, "bad_meta")
    shas = [e["sha256"] for e in entries]
    if parts.index_digest(shas) != doc["weights_sha256"]:
        raise CheckpointError(f"{json_path.name}: its weights_sha256 is not the digest of its parts' digests "
                              "(the file was edited)", json_path, "edited")
    return [json_path.parent / e["file"] for e in entries]


@dataclass(frozen=True)
class VerifyShare:
    """Ranks that verify a checkpoint together (docs/checkpoints.md, "Sharded checkpoints"): every
    rank checks every file's size, this rank hashes files ``rank``, ``rank + world``, ...; ``agree``
    (a collective every rank calls once per checkpoint verified) is true when every rank found its
    files intact. Each file is hashed once in all instead of once per rank."""

    rank: int
    world: int
    agree: Callable[[bool], bool]


def verify_weights(info: CheckpointInfo, share: VerifyShare | None = None) -> None:
    """Check that the weights file (or every part) exists and has the size and SHA-256 its JSON
    recorded; with ``share``, hash only this rank's share of the files and agree with the others."""
    if info.parts:
        files_ = [(path, e["size"], e["sha256"]) for path, e in zip(info.parts, info.doc["weights_parts"], strict=True)]
    else:
        files_ = [(info.weights_path, info.doc["weights_size"], info.doc["weights_sha256"])]
    for path, size, _ in files_:  # the same answer on every rank: no collective needed before it
        _check_size(info, path, size)
    mine = files_ if share is None else files_[share.rank::share.world]
    failed: CheckpointError | None = None
    try:
        for path, _, sha in mine:
            _check_sha(path, sha)
    except CheckpointError as err:
        failed = err
    if share is not None and not share.agree(failed is None) and failed is None:
        failed = CheckpointError(f"{info.json_path.name}: another rank found one of its files corrupt (SHA-256 "
                                 "mismatch; that rank's warning names it)", info.json_path, "sha_mismatch")
    if failed is not None:
        raise failed


def _check_size(info: CheckpointInfo, path: Path, want_size: int) -> None:
    if not path.exists():
        raise CheckpointError(f"{path.name} (named by {info.json_path.name}) does not exist",
                              path, "missing_weights")
    size = path.stat().st_size
    if size != want_size:
        reason = "truncated" if size < want_size else "size_mismatch"
        what = "is truncated" if size < want_size else "has the wrong size"
        raise CheckpointError(f"{path.name} {what}: {size} bytes, its JSON recorded {want_size}",
                              path, reason, expected=f"{want_size} bytes", got=f"{size} bytes")


def _check_sha(path: Path, want_sha: str) -> None:
    sha, _ = files.sha256_file(path)
    if sha != want_sha:
        raise CheckpointError(f"{path.name} is corrupt: its SHA-256 does not match its JSON", path,
                              "sha_mismatch", expected=want_sha, got=sha)


def _read_header(path: Path) -> dict:
    try:
        check_regular(path, "checkpoint weights")  # a FIFO would block the open below
        return read_safetensors_header(path)
    except InputError as err:
        raise CheckpointError(err.findings[0].message, path, "bad_weights") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path.name} is not a readable safetensors file: {err}", path,
                              "bad_weights") from None


def _check_self_consistent(info: CheckpointInfo, meta: dict) -> None:
    """A JSON that disagrees with itself is an edited (or mixed-up) checkpoint, refused or fallen back
    past like a corrupt one, never resumed into: weights whose own header records another step (the
    weights of another step, with their digest copied into this JSON), or more optimizer updates than
    steps (one step makes at most one update; fp16 overflows and gated steps make none)."""
    for path in info.weights_files:
        recorded = _read_header(path).get("__metadata__")
        step = recorded.get("step") if isinstance(recorded, dict) else None
        if isinstance(step, str) and step != str(info.step):
            raise CheckpointError(
                f"{path.name} holds the weights of step {step:.20}, but {info.json_path.name} says step "
                f"{info.step} (the files were swapped or the JSON edited)", path, "edited",
                expected=f"weights of step {info.step}", got=f"weights of step {step:.20}")
    engine = meta.get("engine")
    updates = engine.get("optimizer_steps") if isinstance(engine, dict) else None
    if isinstance(updates, int) and not isinstance(updates, bool) and updates > info.step:
        raise CheckpointError(
            f"{info.json_path.name} records {updates} optimizer updates at step {info.step}; a run makes at most "
            "one per step (the JSON was edited or belongs to another run)", info.json_path, "edited",
            expected=f"at most {info.step} optimizer updates", got=f"{updates}")


def check_weights(info: CheckpointInfo) -> None:
    """The weights on disk are those the JSON recorded (size, SHA-256) and agree with it (their own
    step, the optimizer's count): what a reader that does not load (``apr inspect``) checks."""
    verify_weights(info)
    _check_self_consistent(info, {k: v for k, v in info.doc.items() if k not in RESERVED_KEYS})


def checkpoint_shapes(info: CheckpointInfo) -> tuple[dict, dict]:
    """The whole tensors' shapes and dtypes from the weights file's header (or its parts')."""
    if not info.parts:
        return _header_shapes(info.weights_path)
    headers = [_read_header(p) for p in info.parts]
    shapes, dtypes, problems = parts.merged_shapes(headers, [p.name for p in info.parts])
    if problems:
        raise CheckpointError(f"{info.json_path.name}: its parts do not make one checkpoint: "
                              + "; ".join(problems[:4]), info.parts[0], "bad_weights")
    return shapes, {n: files.ST_DTYPE_NAMES.get(d, d) for n, d in dtypes.items()}


def _header_shapes(path: Path) -> tuple[dict, dict]:
    rev = files.ST_DTYPE_NAMES
    header = _read_header(path)
    shapes, dtypes = {}, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(entry["shape"])
            dtypes[name] = rev.get(entry["dtype"], entry["dtype"])
        except (TypeError, KeyError):
            raise CheckpointError(f"{path.name}: malformed header entry {name!r}", path, "bad_weights") from None
    return shapes, dtypes


def read_checkpoint(path: str | os.PathLike, config: Any = None, verify: bool = True,
                    weights_only: bool = False, trainer_state: bool = False, lazy: bool = False,
                    share: VerifyShare | None = None) -> TrainState:
    """Load one checkpoint (its .json or .safetensors path). Raises CheckpointError when it is
    missing, truncated, corrupt (SHA-256), not an apr checkpoint, its tensors do not match the model
    of its own config ("foreign"), or (with ``config``) it was saved for a different model.
    ``weights_only`` leaves the optimizer state on disk (export needs only the weights);
    ``trainer_state`` also requires the trainer's state a resume needs (data cursor, engine, RNG);
    ``lazy``: the tensors as a ``parts.LazyTensors`` (read when asked, or row by row) instead of a dict;
    ``share``: the ranks that verify it together (every rank of a run calls this for the same files)."""
    info = read_info(_json_for(Path(path)))
    meta = files.decode_floats({k: v for k, v in info.doc.items() if k not in RESERVED_KEYS})
    if trainer_state:
        try:
            sidecar.check_trainer_state(info.json_path.name, meta)
        except sidecar.SidecarProblem as err:
            raise CheckpointError(str(err), info.json_path, err.reason) from None
    if verify:
        verify_weights(info, share)
    else:
        for path in info.weights_files:
            if not path.exists():
                raise CheckpointError(f"{path.name} does not exist", path, "missing_weights")
    _check_self_consistent(info, meta)
    shapes, dtypes = checkpoint_shapes(info)
    try:
        loss_tensors = loss_state_shapes(info.doc)  # a loss part's own tensors (names.LOSS_PREFIX)
    except ValueError as err:
        raise CheckpointError(f"{info.json_path.name}: {err}", info.json_path, "not_apr") from None
    try:
        own_expected = _expected(info.config, info.step) | loss_tensors
    except Exception as err:  # pydantic ValidationError, KeyError, TypeError: a JSON we did not write
        raise CheckpointError(f"{info.json_path.name}: its config has no valid model.architecture ({err})",
                              info.json_path, "not_apr") from None
    problems = tensor_mismatches(shapes, dtypes, own_expected, stored_dtype(info.config))
    if problems:
        raise CheckpointError(
            f"{info.weights_path.name} does not hold the model its JSON describes (foreign file): "
            + "; ".join(problems[:4]), info.weights_path, "foreign")
    if config is not None:
        problems = tensor_mismatches(shapes, dtypes, _expected(config, info.step) | loss_tensors,
                                     stored_dtype(config))
        if problems:
            raise CheckpointError(
                f"{info.json_path.name} was saved for a different model than the config describes: "
                + "; ".join(problems[:4]), info.json_path, "model_mismatch",
                findings=[Finding("error", "checkpoint.model_mismatch", p, file=str(info.json_path))
                          for p in problems[:20]])

    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        if lazy:
            tensors = parts.LazyTensors(info.weights_files, lambda n: not (weights_only and is_optimizer_state(n)))
        elif info.parts:
            tensors = parts.load(info.parts, lambda n: not (weights_only and is_optimizer_state(n)))
        elif weights_only:
            with safe_open(str(info.weights_path), framework="pt") as f:
                tensors = {n: f.get_tensor(n) for n in f.keys() if not is_optimizer_state(n)}
        else:
            tensors = load_file(str(info.weights_path))
    except Exception as err:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"{info.weights_path.name} cannot be read: {err}", info.weights_path,
                              "bad_weights") from None
    return TrainState(step=info.step, tensors=tensors, meta=meta, info=info)


@dataclass
class CheckpointEntry:
    """One checkpoint found in a run directory (not verified)."""

    step: int
    json_path: Path
    weights_path: Path
    complete: bool  # the JSON and the weights (the file or a sharded run's parts) present
    parts: list[Path] = field(default_factory=list)  # per-rank weights files of this step, if any


def scan(run_dir: str | os.PathLike) -> list[CheckpointEntry]:
    """Step checkpoints in a run directory by file name, newest first. Incomplete pairs (weights
    without JSON: a crash during the save) are listed with ``complete=False``."""
    run_dir = Path(run_dir)
    steps: set[int] = set()
    try:
        names = os.listdir(run_dir)
    except OSError:  # missing, a file, a path under a file, a name too long: no checkpoints there
        return []
    by_stem: dict[str, list[Path]] = {}
    for name in names:
        m = files.STEP_FILE_RE.match(name)
        if m:
            steps.add(int(m.group(1)))
        elif (m := parts.PART_RE.match(name)) and m.group(1).startswith(files.STEP_PREFIX):
            steps.add(int(m.group(1).removeprefix(files.STEP_PREFIX)))
            by_stem.setdefault(m.group(1), []).append(run_dir / name)
    out = []
    for step in sorted(steps, reverse=True):
        stem = files.step_stem(step)
        j, w = run_dir / f"{stem}.json", run_dir / f"{stem}.safetensors"
        found = sorted(by_stem.get(stem, []))
        out.append(CheckpointEntry(step, j, w, complete=j.exists() and (w.exists() or bool(found)), parts=found))
    return out


def load_latest(run_dir: str | os.PathLike, config: Any = None,
                warn: Callable[[str], None] | None = None, weights_only: bool = False,
                trainer_state: bool = False, lazy: bool = False, share: VerifyShare | None = None) -> TrainState:
    """The newest usable step checkpoint of a run directory, falling back to older ones (and, when
    no step checkpoint is usable, to checkpoint-best) past truncated, corrupt or foreign ones. Each
    skipped checkpoint is reported through ``warn``. ``share``: see ``read_checkpoint`` (the ranks
    see the same files, so they take the same fallbacks)."""
    run_dir = Path(run_dir)
    warn = warn or log.warning
    entries = scan(run_dir)
    failures: list[CheckpointError] = []
    newest: str | None = None
    interrupted: list[str] = []
    for entry in entries:
        if not entry.json_path.exists():
            what = entry.parts[0].name if entry.parts else entry.weights_path.name
            interrupted.append(what)
            warn(f"{what} has no JSON (the run stopped while saving it): not a checkpoint; ignored")
            continue
        newest = newest or entry.json_path.name
        try:
            state = read_checkpoint(entry.json_path, config, weights_only=weights_only, trainer_state=trainer_state,
                                    lazy=lazy, share=share)
        except CheckpointError as err:
            if err.reason not in FALLBACK_REASONS:
                raise
            failures.append(err)
            warn(f"{err.message}; trying an older checkpoint")
            continue
        if failures:
            warn(f"resuming from {entry.json_path.name} (step {state.step}), not from {newest}, "
                 "which is unusable")
        return state
    best = run_dir / f"{files.BEST_STEM}.json"
    if best.exists():
        try:
            state = read_checkpoint(best, config, weights_only=weights_only, trainer_state=trainer_state, lazy=lazy,
                                    share=share)
        except CheckpointError as err:
            if err.reason not in FALLBACK_REASONS:
                raise
            failures.append(err)
        else:
            if failures:
                warn(f"no step checkpoint is usable; resuming from {best.name} (step {state.step})")
            return state
    if not failures and interrupted:
        raise _only_interrupted(run_dir, interrupted)
    if not failures:
        raise CheckpointError(f"no checkpoint in {run_dir}", run_dir, "none_found",
                              expected="checkpoint-step-N.json and .safetensors")
    raise CheckpointError(f"no usable checkpoint in {run_dir}: all {len(failures)} are damaged", run_dir,
                          "none_usable", findings=[f for e in failures for f in e.findings])


def _only_interrupted(run_dir: Path, names: list[str]) -> CheckpointError:
    """``--resume latest`` on a folder whose only checkpoint files lack their JSON: a run killed while
    writing its first checkpoint (apr's own weights: a fresh apply replaces them), or files of the user's."""
    ours = set(files.interrupted_saves(run_dir))
    if all(n in ours for n in names):
        message = (f"no checkpoint in {run_dir}: {', '.join(names[:3])} "
                   f"{'is the weights' if len(names) == 1 else 'are weights'} of an interrupted save (the run "
                   "stopped before writing the JSON), not a checkpoint; nothing can be resumed: start the run "
                   "afresh (apr train apply without --resume, which replaces those files)")
    else:
        theirs = [n for n in names if n not in ours]
        message = (f"no checkpoint in {run_dir}: {', '.join(theirs[:3])} has no JSON and is not weights apr "
                   "wrote; move it out of the folder, then start the run afresh (apr train apply without --resume)")
    return CheckpointError(message, run_dir, "none_found", expected="checkpoint-step-N.json and .safetensors",
                           got="weights without their JSON")


# ------------------------------------------------------------------------------------ manager


def checkpoint_run_id(json_path: str | os.PathLike) -> str | None:
    """The run id a checkpoint's JSON records (``run_id``, written by the trainer), or None when the
    file is unreadable or older than run ids."""
    try:
        doc = load_json(json_path, "checkpoint", "checkpoint")
    except AprError:
        return None
    value = doc.get("run_id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else None


def folder_run_ids(run_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Run id -> checkpoint JSON names in ``run_dir`` (step checkpoints and checkpoint-best) that
    record it: which runs' checkpoints a folder holds. Files without a run id are not counted."""
    run_dir = Path(run_dir)
    out: dict[str, list[str]] = {}
    jsons = [e.json_path for e in scan(run_dir) if e.json_path.exists()]
    best = run_dir / f"{files.BEST_STEM}.json"
    if best.exists():
        jsons.append(best)
    for j in jsons:
        rid = checkpoint_run_id(j)
        if rid is not None:
            out.setdefault(rid, []).append(j.name)
    return out


class OtherRunError(CheckpointError):
    """A resume would write one run's checkpoints into a folder holding another run's."""


def refuse_overwriting_other_run(json_path: Path, run_id: str | None) -> None:
    """Never write over a checkpoint another run wrote (a folder shared with --allow-other-run whose
    step numbers collide, or its ``checkpoint-best``): the other run's files stay as they are."""
    if run_id is None or not json_path.exists():
        return
    theirs = checkpoint_run_id(json_path)
    if theirs is None or theirs == run_id:
        return
    message = (f"{json_path} is run {theirs}'s checkpoint; run {run_id} would overwrite it: another run's files "
               "are never replaced (resume into an empty training.output_dir instead)")
    raise OtherRunError(message, json_path, "other_run", findings=[Finding(
        "error", "checkpoint.other_run", message, path="training.output_dir", file=str(json_path),
        expected=f"no checkpoint of another run named {json_path.name}", got=f"run {theirs}'s checkpoint")])


def refuse_other_runs(output_dir: str | os.PathLike, json_path: str | os.PathLike,
                      allow: bool = False) -> None:
    """Resuming from ``json_path`` into ``output_dir``: refuse (unless ``allow``, an explicit opt-in:
    ``CheckpointManager.allow_other_run``) when the folder holds checkpoints of a run other than the
    checkpoint's.
    Saving there would replace that run's ``checkpoint-best`` and mix two timelines in one folder."""
    mine = checkpoint_run_id(json_path)
    if mine is None or allow:
        return
    others = {rid: names for rid, names in folder_run_ids(output_dir).items() if rid != mine}
    if not others:
        return
    rid, names = sorted(others.items())[0]
    shown = ", ".join(sorted(names)[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
    message = (f"{output_dir} holds checkpoints of run {rid} ({shown}), but the checkpoint to resume, "
               f"{json_path}, is of run {mine}: resuming would write its checkpoints (and checkpoint-best) "
               "over that run's folder. Choose another training.output_dir (an empty folder takes the resume), "
               "or move that run's checkpoints away")
    raise OtherRunError(message, Path(json_path), "other_run", findings=[Finding(
        "error", "resume.other_run", message, path="training.output_dir", file=str(json_path),
        expected=f"an output folder holding only run {mine}'s checkpoints", got=f"checkpoints of run {rid}")])


class CheckpointManager:
    """Writes a run's checkpoints, keeps the latest ``keep_last`` plus the best, and loads them back.

    ``config`` is the run's AprConfig (or its JSON dict); ``config_hash`` its hash
    (``apr.config.config_hash``); ``keep_last`` defaults to ``training.keep_last``. Only one process
    may save into a run directory (rank 0 under data parallelism).
    """

    def __init__(self, output_dir: str | os.PathLike, config: Any, config_hash: str | None = None,
                 keep_last: int | None = None, on_warning: Callable[[str], None] | None = None,
                 trainer_state: bool = False):
        self.output_dir = Path(output_dir)
        self.config = config
        if isinstance(config, Mapping):
            self.config_doc = dict(config)
            training = self.config_doc.get("training", {})
            default_keep = training.get("keep_last", 1)
        else:
            self.config_doc = config.model_dump(mode="json")
            default_keep = config.training.keep_last

        # Recorded as the stored doc's own hash, which readers check it against (sidecar.check_head);
        # a caller's ``config_hash`` (of the config as loaded, before run-time resolution) is not used.
        self.config_hash = config_doc_hash(self.config_doc)
        self.allow_other_run = False  # opt in to resuming into a folder holding another run's checkpoints
        self.keep_last = int(keep_last if keep_last is not None else default_keep)
        if self.keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self._on_warning = on_warning
        self.trainer_state = trainer_state  # loads require the trainer's state (a resume)
        self._config = config
        self.warnings: list[str] = []  # what the last load() skipped or fell back past
        self._writer: BackgroundWriter | None = None  # background saves (created by the first one)

    # -------------------------------------------------------------------------------- paths

    def step_paths(self, step: int) -> tuple[Path, Path]:
        stem = files.step_stem(step)
        return self.output_dir / f"{stem}.json", self.output_dir / f"{stem}.safetensors"

    @property
    def best_paths(self) -> tuple[Path, Path]:
        return self.output_dir / f"{files.BEST_STEM}.json", self.output_dir / f"{files.BEST_STEM}.safetensors"

    # --------------------------------------------------------------------------------- save

    def _expected_at(self, step: int) -> dict:
        """The tensors a checkpoint of ``step`` holds (progressive stacking: that stage's depth)."""
        return _expected(self._config, step)

    def _check_state(self, state: TrainState) -> None:
        problems = torch_mismatches(state.tensors, self._expected_at(state.step) | loss_state_shapes(state.meta),
                                    stored_dtype(self._config))
        if problems:
            raise ValueError("TrainState.tensors do not match the config's model: " + "; ".join(problems[:5]))
        clash = RESERVED_KEYS & set(state.meta)
        if clash:
            raise ValueError(f"TrainState.meta may not use the reserved keys {sorted(clash)}")

    def _doc(self, step: int, is_best: bool, weights_name: str, sha: str, size: int, meta: dict) -> dict:

        head = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "is_best": bool(is_best),
            "weights_file": weights_name,
            "weights_sha256": sha,
            "weights_size": size,
            "tensor_count": len(self._expected_at(step) | loss_state_shapes(meta)),
            "apr_version": __version__,
            "saved_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "cwd": os.getcwd(),
        }
        tail = {"config_hash": self.config_hash, "config": self.config_doc}
        return {**head, **files.encode_floats(meta), **tail}

    def save(self, state: TrainState, is_best: bool = False, background: bool = False) -> Path:
        """Write ``checkpoint-step-N.*`` (and ``checkpoint-best.*`` when ``is_best``), then prune older
        step checkpoints beyond ``keep_last``. Returns the JSON path of the step checkpoint. A full
        disk (or quota, or a read-only file system) is a CheckpointError naming the file and the space
        needed; the previous checkpoints are untouched (docs/checkpoints.md).

        ``background``: snapshot the tensors to host memory and write on the writer thread
        (apr/checkpoint/background.py); the path is returned before the files exist, and
        ``collect``/``wait`` report the writes as they complete."""
        self._check_state(state)
        step = int(state.step)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        json_path, weights_path = self.step_paths(step)
        if self.allow_other_run:  # a shared folder: never over another run's files
            for path in (json_path, *([self.best_paths[0]] if is_best else [])):
                refuse_overwriting_other_run(path, state.meta.get("run_id"))
        needed = sum(t.numel() * t.element_size() for t in state.tensors.values()) + _JSON_ALLOWANCE
        if not background:
            self.wait()  # never two writers in one folder
            self._check_free_space(weights_path, needed)
            return self._write_or_disk_error(state, step, is_best, json_path, weights_path, needed)
        if self._writer is None:
            self._writer = BackgroundWriter()
        self._writer.wait_idle()  # one snapshot in host memory at a time; a failed write raises here
        self._check_free_space(weights_path, needed)
        copy = TrainState(step=step, tensors=snapshot(state.tensors), meta=state.meta)
        self._writer.submit(step, is_best, lambda: self._write_or_disk_error(copy, step, is_best, json_path,
                                                                               weights_path, needed))
        return json_path

    def collect(self) -> list[tuple[int, Path, bool]]:
        """Background writes completed since the last call: (step, JSON path, is_best), oldest first."""
        return self._writer.collect() if self._writer is not None else []

    def wait(self) -> list[tuple[int, Path, bool]]:
        """Wait for the background write in flight; then as ``collect``."""
        if self._writer is None:
            return []
        self._writer.wait_idle()
        return self._writer.collect()

    def _write_or_disk_error(self, state: TrainState, step: int, is_best: bool, json_path: Path,
                             weights_path: Path, needed: int) -> Path:
        try:
            return self._write(state, step, is_best, json_path, weights_path)
        except OSError as err:
            if err.errno not in _DISK_ERRNOS:
                raise
            raise _disk_error(err, weights_path, needed,
                              _free_bytes(self.output_dir)) from None

    def _check_free_space(self, weights_path: Path, needed: int) -> None:
        free = _free_bytes(self.output_dir)
        if free is not None and free < needed:
            raise _disk_error(OSError(errno.ENOSPC, "not enough free space"), weights_path, needed, free,
                              what="not enough free space")

    def _write(self, state: TrainState, step: int, is_best: bool, json_path: Path, weights_path: Path) -> Path:
        # Rewriting a step (a resumed run passing it again): retire the old pair before its weights change.
        self._retire(json_path, files.step_stem(step))
        sha, size = files.write_safetensors(weights_path, state.tensors, metadata=_weights_metadata(step))
        doc = self._doc(step, is_best, weights_path.name, sha, size, state.meta)
        atomic_write_json(json_path, doc)
        if is_best:
            best_json, best_weights = self.best_paths
            # Same order as a step save: the old best pair stops looking complete before it changes.
            self._retire(best_json, files.BEST_STEM)
            files.link_or_copy(weights_path, best_weights)
            atomic_write_json(best_json, {**doc, "weights_file": best_weights.name, "is_best": True})
        self.prune(keep_step=step)
        return json_path

    def _retire(self, json_path: Path, stem: str, weights: bool = False) -> None:
        """Before ``stem`` is written again: its JSON goes first (so nothing of it looks complete),
        then any per-rank parts (another layout or number of ranks) and, with ``weights``, the file."""
        gone = files.unlink_quiet(json_path)
        for p in parts.parts_of(self.output_dir, stem):
            gone = files.unlink_quiet(p) or gone
        if weights:
            gone = files.unlink_quiet(self.output_dir / f"{stem}.safetensors") or gone
        if gone:
            fsync_dir(self.output_dir)

    # ------------------------------------------------------------------------- sharded saves

    def save_part(self, state: TrainState, rank: int, world: int, exchange, is_best: bool = False,
                  parts_total: int | None = None) -> Path:
        """A sharded run's checkpoint: every rank calls this with its own rows of every tensor (a
        collective). Rank 0 retires an older save of the step, ranks ``0 .. parts_total - 1``
        (default: all; hybrid sharding: the first replica's) each write their part, the parts'
        (SHA-256, size) are exchanged (``exchange(sha, size)`` returns every rank's, in rank order,
        on every rank), then rank 0 writes the JSON, last, and the best copy, and prunes.
        Synchronous: the JSON may only follow every part. Returns the step's JSON path."""
        step = int(state.step)
        clash = RESERVED_KEYS & set(state.meta)
        if clash:
            raise ValueError(f"TrainState.meta may not use the reserved keys {sorted(clash)}")
        problems = [p for p in torch_mismatches(state.tensors, self._expected_at(step) | loss_state_shapes(state.meta),
                                                stored_dtype(self._config)) if "shape" not in p]
        if problems:
            raise ValueError("TrainState.tensors do not match the config's model: " + "; ".join(problems[:5]))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        json_path, weights_path = self.step_paths(step)
        stem = files.step_stem(step)
        if rank == 0:
            self.wait()
            self._retire(json_path, stem, weights=True)
        exchange("", 0)  # nobody writes a part before the old save of this step is retired
        count = parts_total or world
        if rank >= count:  # another replica of the same rows (hybrid sharding): the first one writes
            exchange("", 0)
            return json_path
        part = self.output_dir / parts.part_name(stem, rank, count)
        needed = sum(t.numel() * t.element_size() for t in state.tensors.values()) + _JSON_ALLOWANCE
        try:
            self._check_free_space(part, needed)
            sha, size = parts.write_part(part, state.tensors, step, rank, count)
        except Exception as err:
            exchange("", 0)  # the other ranks learn that this part is missing instead of waiting for it
            if isinstance(err, OSError) and err.errno in _DISK_ERRNOS:
                raise _disk_error(err, part, needed, _free_bytes(self.output_dir)) from None
            raise
        records = exchange(sha, size)[:count]
        if rank != 0:
            return json_path
        if any(not sha for sha, _ in records):
            raise CheckpointError(f"a rank could not write its part of step {step}", json_path, "missing_weights")
        names = [parts.part_name(stem, r, count) for r in range(count)]
        entries = [{"file": n, "sha256": sha, "size": size} for n, (sha, size) in zip(names, records, strict=True)]
        doc = self._doc(step, is_best, names[0], parts.index_digest([e["sha256"] for e in entries]),
                        sum(e["size"] for e in entries), state.meta)
        doc = {**doc, "format_version": PARTS_FORMAT_VERSION, "weights_parts": entries}
        atomic_write_json(json_path, doc)
        if is_best:
            best_json, _ = self.best_paths
            self._retire(best_json, files.BEST_STEM, weights=True)
            best = [parts.part_name(files.BEST_STEM, r, count) for r in range(count)]
            for src, dst in zip(names, best, strict=True):
                files.link_or_copy(self.output_dir / src, self.output_dir / dst)
            atomic_write_json(best_json, {**doc, "weights_file": best[0], "is_best": True, "weights_parts": [
                {**e, "file": b} for e, b in zip(entries, best, strict=True)]})
        self.prune(keep_step=step)
        return json_path

    def prune(self, keep_step: int) -> list[Path]:
        """Delete step checkpoints other than ``keep_step`` and the ``keep_last - 1`` newest complete
        ones before it; also incomplete pairs, pairs from later steps (a timeline abandoned by resuming
        from an earlier checkpoint) and temp files of interrupted saves. JSON goes first, so a pair
        being deleted never looks complete. Returns the deleted paths."""
        mine = checkpoint_run_id(self.step_paths(keep_step)[0])
        entries = scan(self.output_dir)
        runs = {e.step: checkpoint_run_id(e.json_path) if e.json_path.exists() else None for e in entries}
        # another run's checkpoints (a folder shared with --allow-other-run) are never deleted, nor
        # counted in keep_last; while any is there, a pair that names no run is left alone too
        foreign = {step for step, rid in runs.items() if mine is not None and rid is not None and rid != mine}
        unattributed = {step for step, rid in runs.items() if rid is None} if foreign else set()
        keep = {keep_step} | foreign | unattributed
        older = [e for e in entries if e.complete and e.step < keep_step and e.step not in foreign]
        keep.update(e.step for e in older[: self.keep_last - 1])
        deleted, interrupted = [], []
        for entry in entries:
            if entry.step in keep:
                continue
            for p in (entry.json_path, entry.weights_path, *entry.parts):
                if files.unlink_quiet(p):
                    deleted.append(p)
                    if not entry.complete and p != entry.json_path:
                        interrupted.append(p.name)
        if interrupted:  # never silently: a file under a checkpoint's name without its JSON
            self._warn(f"removed {', '.join(interrupted)}: weights without their JSON (an interrupted save), "
                       "not a checkpoint")
        for name in os.listdir(self.output_dir):
            if files.TEMP_RE.match(name) and files.unlink_quiet(self.output_dir / name):
                deleted.append(self.output_dir / name)
        if deleted:
            fsync_dir(self.output_dir)
        return deleted

    # --------------------------------------------------------------------------------- load

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        if self._on_warning is not None:
            self._on_warning(message)
        else:
            log.warning(message)

    def load(self, which: str | os.PathLike = "latest", lazy: bool = False,
             share: VerifyShare | None = None) -> tuple[TrainState, Path]:
        """``"latest"``: the newest usable checkpoint in the output directory, falling back past damaged
        ones (each fallback is reported through ``on_warning`` and kept in ``self.warnings``). A path (a
        checkpoint's .json or .safetensors, or a run directory meaning its latest): exactly that one,
        refused if damaged. Returns the state (CPU tensors; ``lazy``: read when asked, see
        ``read_checkpoint``) and the checkpoint's JSON path. ``share``: the ranks verifying it together."""
        self.warnings = []
        kw = {"trainer_state": self.trainer_state, "lazy": lazy, "share": share}
        if str(which) == "latest":
            state = load_latest(self.output_dir, self.config, self._warn, **kw)
        else:
            path = Path(which)
            if path.is_dir():
                state = load_latest(path, self.config, self._warn, **kw)
            else:
                state = read_checkpoint(path, self.config, **kw)
        assert state.info is not None
        refuse_other_runs(self.output_dir, state.info.json_path, allow=self.allow_other_run)
        return state, state.info.json_path
