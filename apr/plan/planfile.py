"""Plan files: `apr train plan CONFIG -out plan.json` saves one, `apr train apply plan.json` reads it.

A plan file is ``Plan.to_dict()``: besides the findings and facts it holds the resolved config, its
SHA-256 and the data fingerprint (name, size, mtime and content digest of every file of the train
and val data and the tokenizer; the digest reads all of a small file, samples of a large one).
``check_plan_fresh`` recomputes both and refuses a plan whose config or data changed since, saying
exactly what changed, like Terraform refusing a stale saved plan.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from apr import __version__
from apr.checkpoint.compat import normalise_config
from apr.config import config_hash, load_config
from apr.config.loader import config_doc_hash
from apr.errors import AprError, Finding
from apr.fsutil import atomic_write_json
from apr.plan.build import PLAN_FORMAT, PLAN_FORMAT_VERSION, Plan, data_fingerprint, normalise_overrides
from apr.plan.fit import fitted_settings
from apr.readers import load_json

_REQUIRED = ("config_path", "config_hash", "data_fingerprint")
_MAX_LISTED = 8


def save_plan(plan: Plan, path: str | os.PathLike) -> dict:
    """Write ``plan.to_dict()`` to ``path`` atomically (temp file, fsync, rename); return the document."""

    doc = plan.to_dict()
    path = Path(path)
    try:
        atomic_write_json(path, doc)
    except OSError as e:
        raise AprError(f"cannot write the plan file {path}: {e.strerror or e}", [Finding(
            "error", "plan.unwritable", f"cannot write: {e.strerror or e}", file=str(path),
            expected="a writable path in an existing folder")]) from None
    return doc


def _plan_error(file: str, code: str, message: str, **kw) -> AprError:
    return AprError(message, [Finding("error", code, message, file=file, **kw)])


def load_plan_file(path: str | os.PathLike) -> dict:
    """Read a plan file saved by `apr train plan -out`. Raises AprError for a missing, unreadable,
    malformed or foreign file, or one from an unsupported format version."""
    path = Path(path)
    file = str(path)
    hint = f"make one with `apr train plan CONFIG -out {file}`"

    if not os.path.lexists(path):
        raise _plan_error(file, "plan.missing", f"plan file not found: {file} ({hint})",
                          expected="a plan file (JSON)", got="nothing")
    doc = load_json(path, "plan", "plan file", error=AprError)  # bounded: size, nesting, FIFOs
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        got = f'"format": {json.dumps(doc.get("format"))}' if isinstance(doc, dict) else type(doc).__name__
        raise _plan_error(file, "plan.foreign", f'{file} is not an apr plan file (no "format": "{PLAN_FORMAT}"); '
                                                f"{hint}", expected=f'"format": "{PLAN_FORMAT}"', got=got)
    if str(doc.get("format_version")) != PLAN_FORMAT_VERSION:
        raise _plan_error(file, "plan.version", f"{file} has plan format version {doc.get('format_version')!r}; "
                                                f"this apr reads version {PLAN_FORMAT_VERSION}; {hint}",
                          expected=PLAN_FORMAT_VERSION, got=str(doc.get("format_version")))
    missing = [k for k in _REQUIRED if k not in doc]
    fp = doc.get("data_fingerprint")
    if not missing and not (isinstance(fp, dict) and isinstance(fp.get("files"), list)):
        missing.append("data_fingerprint.files")
    if missing:
        raise _plan_error(file, "plan.incomplete", f"{file} is an incomplete plan file: missing {', '.join(missing)}; "
                                                   f"{hint}", expected=", ".join(_REQUIRED))
    for key, expected, ok in _field_checks(doc):
        if not ok:
            value = _get(doc, key)
            raise _plan_error(file, "plan.field", f"{file} is not a valid plan file: {key} is not {expected}; {hint}",
                              path=key, expected=expected, got=_show(value)[:80])
    made_by = doc.get("apr_version")
    if made_by != __version__:  # another apr may resolve the same config into another run
        shown = (made_by if isinstance(made_by, str) and made_by.isprintable() else _show(made_by))[:40]
        raise _plan_error(file, "plan.apr_version", f"{file} was planned by apr {shown}; this is apr {__version__}, "
                                                    f"which may resolve it differently; plan again: {hint}",
                          path="apr_version", expected=__version__, got=shown)
    return doc


def _get(doc: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def _field_checks(doc: dict):
    """(key, expected, holds) for every field `apply` reads from a plan file, in reading order."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    yield "config_path", "a path (string)", isinstance(doc["config_path"], str) and 0 < len(doc["config_path"]) < 4096 \
        and "\0" not in doc["config_path"]
    yield "config_hash", "a SHA-256 (string)", isinstance(doc["config_hash"], str)
    yield "config", "a mapping", isinstance(doc.get("config") or {}, dict)
    yield "overrides", "a mapping", isinstance(doc.get("overrides") or {}, dict)
    yield "cwd", "a path (string)", isinstance(doc.get("cwd") or "", str)
    target = doc.get("target")
    yield "target", "a mapping", target is None or isinstance(target, dict)
    if isinstance(target, dict):  # apply passes gpu and vram back to the plan
        yield "target.gpu", "a GPU name (string) or null", target.get("gpu") is None or isinstance(target["gpu"], str)
        yield "target.vram", "a size (string or integer) or null", target.get("vram") is None or (
            isinstance(target["vram"], (str, int)) and not isinstance(target["vram"], bool))
    files = doc["data_fingerprint"]["files"]
    yield "data_fingerprint.files", "a list of {path, size, mtime_ns, digest}", all(
        isinstance(f, dict) and isinstance(f.get("path"), str) and is_int(f.get("size"))
        and is_int(f.get("mtime_ns")) and isinstance(f.get("digest", ""), (str, type(None))) for f in files)


# ---------------------------------------------------------------------------------- freshness


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: doc}


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key path, old value, new value) for every leaf that differs between two resolved configs."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]


def _show(value: Any) -> str:
    return "(absent)" if not isinstance(value, (str, int, float, bool, list, dict, type(None))) else json.dumps(value)


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def data_changes(old_files: list[dict], new_files: list[dict]) -> tuple[list[dict], list[dict], list[tuple]]:
    """(added, removed, changed) files between two fingerprints; changed holds (old, new) pairs."""
    old = {f["path"]: f for f in old_files}
    new = {f["path"]: f for f in new_files}
    added = [new[p] for p in sorted(set(new) - set(old))]
    removed = [old[p] for p in sorted(set(old) - set(new))]
    changed = [(old[p], new[p]) for p in sorted(set(old) & set(new))
               if (old[p]["size"], old[p]["mtime_ns"]) != (new[p]["size"], new[p]["mtime_ns"])
               or ("digest" in old[p] and old[p]["digest"] != new[p].get("digest"))]
    return added, removed, changed


def _short(path: str) -> str:
    """A data file as the user knows it: relative to the current directory when under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def check_plan_fresh(doc: dict) -> Path:
    """The config path to apply, after checking that neither the config nor the data changed since
    the plan was made. Raises AprError listing what changed: the config keys (old -> new), and the
    data files added, removed or changed (size, mtime, content digest). A config that no longer loads raises its
    ConfigError."""

    config_path = Path(doc["config_path"])
    # the values the plan fitted for the config's auto keys are part of what it planned
    loaded = load_config(config_path, normalise_overrides({**(doc.get("overrides") or {}), **fitted_settings(doc)})
                         or None)
    config = loaded.config
    findings: list[Finding] = []
    parts: list[str] = []

    # a plan made by an earlier apr lacks keys added since: filled with their defaults, they are no
    # change; but only a plan whose stored config still hashes to its config_hash (not edited)
    stored = doc.get("config")
    intact = isinstance(stored, dict) and config_doc_hash(stored) == doc["config_hash"]
    planned = normalise_config(stored) if intact else None
    now = config_hash(config)
    if now != doc["config_hash"] and (planned is None or config_doc_hash(planned) != now):
        changes = config_changes(planned, config.model_dump(mode="json")) if planned else []
        for key, before, after in changes:
            file, line, column = loaded.source.where(tuple(key.split(".")))
            findings.append(Finding("error", "plan.stale.config", "changed since the plan was made",
                                    path=key, file=file,
                                    line=line, column=column, expected=_show(before), got=_show(after)))
        if changes:
            parts.append(f"the config changed ({_listed([k for k, _, _ in changes])})")
        else:
            parts.append("the config changed (its hash differs)")
            findings.append(Finding("error", "plan.stale.config", "the config's hash differs from the plan's",
                                    file=str(config_path), expected=doc["config_hash"], got=config_hash(config)))

    fp = data_fingerprint(config)
    added, removed, changed = data_changes(doc["data_fingerprint"]["files"], fp["files"])
    for f in added:
        findings.append(Finding("error", "plan.stale.data", f"added since the plan ({f['size']:,} bytes)",
                                file=f["path"], path=f"data.{f.get('role', 'train')}"))
    for f in removed:
        findings.append(Finding("error", "plan.stale.data", "removed (or moved) since the plan",
                                file=f["path"], path=f"data.{f.get('role', 'train')}"))
    for before, after in changed:
        what = []
        if before["size"] != after["size"]:
            what.append(f"size {before['size']:,} -> {after['size']:,} bytes")
        if before["mtime_ns"] != after["mtime_ns"]:
            what.append(f"modified {_when(before['mtime_ns'])} -> {_when(after['mtime_ns'])}")
        if not what:
            what.append("same size and mtime, different content")
        findings.append(Finding("error", "plan.stale.data", "changed since the plan: " + ", ".join(what),
                                file=after["path"], path=f"data.{after.get('role', 'train')}"))
    if added or removed or changed:
        counts = [f"{len(x)} {word}" for x, word in ((added, "added"), (removed, "removed"), (changed, "changed"))
                  if x]
        names = [_short(f["path"]) for f in added + removed] + [_short(a["path"]) for _, a in changed]
        parts.append(f"the data changed ({', '.join(counts)}: {_listed(names)})")
        if doc.get("cwd") and doc["cwd"] != os.getcwd():
            parts.append(f"note: the plan was made in {doc['cwd']} and relative data paths now resolve from "
                         f"{os.getcwd()}")
    if findings:
        raise AprError(f"the plan is stale: {'; '.join(parts)}. Make a new one with "
                       f"`apr train plan {config_path} -out PLAN.json`", findings)
    return config_path
