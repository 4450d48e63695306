"""The sweep's folder (``--dir``, the file's ``output_dir``, else ``sweeps/NAME``): one sweep's, and
never a place whose files it would mix with or replace (docs/sweeps.md, "The sweep's folder").

``folder_problems`` refuses what can never be a sweep's folder: the checks a run's ``output_dir``
gets (a file, a FIFO, a device, a path under a file, a filesystem root, the home folder, ``$APR_HOME``
or a run's ``.apr/``, a folder that is, holds or lies inside the base config's data), and a run's
own folder. ``claim_folder`` makes the folder the sweep's: it writes ``.apr-sweep.json`` (the
sweep's name and fingerprint) once, atomically, so a second sweep given the same folder is refused
instead of sharing the first one's trial folders, storage and reports; a folder that holds what a
sweep writes (``study.db``, ``trials/``, ``best.yaml``, ...) but no such record is refused too,
unless its storage holds this very sweep (a folder of a version before the record).
``write_report`` is the one write of a report file: only over a report this sweep wrote.
"""

from __future__ import annotations

import html
import json
import os
import sqlite3
import tempfile
from pathlib import Path
from urllib.parse import quote

from apr.config import load_config
from apr.config.paths import output_dir_problems
from apr.errors import AprError, Finding
from apr.fsutil import atomic_write_bytes, check_output_file, output_write_error
from apr.readers import load_json, read_text
from apr.sweep.spec import SweepError, SweepSpec

MARKER = ".apr-sweep.json"
MARKER_FORMAT = "apr-sweep-folder"
# What `apr sweep run` writes into its folder (the reports' names: apr.sweep.results.REPORT_FILES)
SWEEP_NAMES = ("study.db", "trials", "best.yaml", "importance.json", "metric_vs_params.svg", "best-run",
               ".sweep.lock")
# The reports `apr sweep run` writes when it ends (apr/sweep/results.py)
REPORT_FILES = {"best_config": "best.yaml", "importance": "importance.json", "plot": "metric_vs_params.svg"}
# What marks a folder as a training run's (apr/train/outdir.py)
RUN_NAMES = ("training_state.json", ".apr-run.lock", "plan.json")


def _where(spec: SweepSpec, given: str | Path | None) -> tuple[str, str, int | None, int | None]:
    """(the option or key that named the folder, file, line, column) for a finding."""
    if given is not None:
        return "--dir", str(spec.path), None, None
    if spec.output_dir is not None:
        return ("output_dir", *spec.where("output_dir"))
    return "--dir", str(spec.path), None, None


def _refuse(spec: SweepSpec, given, folder: Path, message: str, expected: str, got: str,
            code: str = "sweep.output_dir") -> SweepError:
    key, file, line, column = _where(spec, given)
    return SweepError(f"{key} {folder}: {message}", [Finding(
        "error", code, message, path=key, file=file, line=line, column=column, expected=expected, got=got)])


def folder_problems(spec: SweepSpec, folder: Path, given: str | Path | None = None) -> list[Finding]:
    """Every reason ``folder`` can never be this sweep's folder, as findings at ``--dir`` or the
    file's ``output_dir``. Needs the base config (its data paths); none when it cannot be loaded
    (check_base names that)."""
    key, file, line, column = _where(spec, given)
    out: list[Finding] = []

    def add(message: str, got: str, expected: str = "a folder of the sweep's own") -> None:
        out.append(Finding("error", "sweep.output_dir", message, path=key, file=file, line=line, column=column,
                           expected=expected, got=got))

    if spec.config is not None:
        try:
            loaded = load_config(spec.config, {"training.output_dir": str(folder)})
        except AprError:
            loaded = None
        if loaded is not None:
            for message, got in output_dir_problems(loaded.config):
                message = message.replace("output_dir", f"the sweep's folder ({key})", 1)
                message = message.replace("a run's checkpoints and records need", "the sweep's storage, trials "
                                          "and reports need").replace("the run would", "the sweep's trials would")
                add(message, got)
    if folder.is_dir() and not folder.is_symlink():
        marks = [n for n in RUN_NAMES if os.path.lexists(folder / n)]
        marks += sorted(n for n in _names(folder) if n.startswith("checkpoint-"))[:2]
        if marks:
            add(f"{folder} is a training run's folder (it holds {', '.join(marks[:3])}): the sweep would write "
                "its storage, trials and reports among that run's files", f"a run's folder ({marks[0]})")
    return out


def check_folder(spec: SweepSpec, folder: Path, given: str | Path | None = None) -> None:
    """Raise SweepError listing ``folder_problems``."""
    problems = folder_problems(spec, folder, given)
    if problems:
        key = problems[0].path
        raise SweepError(f"{key} {folder} cannot be the sweep's folder", problems)


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def identity(spec: SweepSpec) -> dict:
    return {"format": MARKER_FORMAT, "format_version": "1", "sweep": spec.name, "fingerprint": spec.fingerprint(),
            "sweep_file": str(Path(os.path.abspath(spec.path)))}


def read_marker(folder: Path) -> dict | None:
    """The folder's sweep record, or None when there is none; a record that is not one raises."""
    path = folder / MARKER
    if not os.path.lexists(path):
        return None
    doc = load_json(path, "manifest", "sweep folder record", error=SweepError)
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        raise SweepError(f"{path} is not a sweep folder record apr wrote", [Finding(
            "error", "sweep.output_dir", "not a sweep folder record apr wrote; apr will not replace it",
            path="--dir", file=str(path), expected=f'a JSON object with "format": "{MARKER_FORMAT}"',
            got="another file")])
    return doc


def _same_sweep(doc: dict, spec: SweepSpec) -> bool:
    return doc.get("sweep") == spec.name and doc.get("fingerprint") == spec.fingerprint()


def _legacy_own(spec: SweepSpec, folder: Path) -> bool:
    """A folder of a version before the record: its SQLite storage holds this sweep's study."""
    db = folder / "study.db"
    if not db.is_file():
        return False
    try:
        conn = sqlite3.connect(f"file:{quote(str(db.resolve()))}?mode=ro", uri=True, timeout=5.0)
        try:
            rows = conn.execute("SELECT s.study_name, a.value_json FROM studies s JOIN study_user_attributes a "
                                "ON a.study_id = s.study_id WHERE a.key = 'apr_sweep'").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return False
    for name, value in rows:
        try:
            fingerprint = json.loads(value).get("fingerprint")
        except (ValueError, AttributeError):
            continue
        if name == spec.name and fingerprint == spec.fingerprint():
            return True
    return False


def claim_folder(spec: SweepSpec, folder: Path, given: str | Path | None = None) -> None:
    """Make ``folder`` this sweep's (created when absent), or raise SweepError when it is another
    sweep's, or holds what a sweep writes without being this sweep's. Safe against a second sweep
    claiming the same new folder at the same moment: the record is linked into place, never replaced."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise output_write_error(folder, "--dir", err) from None
    doc = read_marker(folder)
    if doc is None:
        found = [n for n in SWEEP_NAMES if os.path.lexists(folder / n)]
        if found and not _legacy_own(spec, folder):
            raise _refuse(spec, given, folder, f"{folder} holds {', '.join(found[:4])} of no sweep apr recorded "
                          f"there: sweep {spec.name} would mix its files with them or replace them",
                          "a new or empty folder, or this sweep's own", ", ".join(found[:4]), "sweep.folder_in_use")
        body = (json.dumps(identity(spec), indent=1) + "\n").encode()
        fd, tmp = tempfile.mkstemp(prefix=f".{MARKER}.", suffix=".tmp", dir=folder)
        try:
            os.write(fd, body)
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, folder / MARKER)  # fails when another sweep linked its record first
            except FileExistsError:
                pass
        except OSError as err:
            raise output_write_error(folder / MARKER, "--dir", err) from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        doc = read_marker(folder) or {}
    if not _same_sweep(doc, spec):
        raise _refuse(spec, given, folder, f"{folder} is the folder of sweep {doc.get('sweep')!s:.60} (of "
                      f"{doc.get('sweep_file')!s:.200}); two sweeps never share a folder: their trials' runs, "
                      "storage and reports would mix", "a folder of this sweep's own (another --dir or output_dir)",
                      f"sweep {doc.get('sweep')!s:.60}'s folder", "sweep.folder_in_use")
    for name in REPORT_FILES.values():
        path = folder / name
        if os.path.lexists(path) and not is_own_report(path, spec):
            raise _refuse(spec, given, folder, f"{path} is not a report of sweep {spec.name}; apr will not replace "
                          "it", f"no {name} but this sweep's own", "another file", "sweep.folder_in_use")


def is_own_report(path: Path, spec: SweepSpec) -> bool:
    """Whether ``path`` is a report this sweep wrote (best.yaml, importance.json, the plot): the only
    file of those names `apr sweep run` replaces."""
    try:
        text = read_text(path, "manifest", "sweep report")
    except AprError:  # a folder, a FIFO, a device, a symlink loop, too large, not UTF-8
        return False
    if path.name == REPORT_FILES["best_config"]:
        first = text.split("\n", 1)[0]
        return first.startswith("# the best trial (") and f") of sweep {spec.name}, on " in first
    if path.name == REPORT_FILES["importance"]:
        try:
            doc = json.loads(text)
        except ValueError:
            return False
        return (isinstance(doc, dict) and doc.get("evaluator") == "fanova"
                and doc.get("sweep", spec.name) == spec.name)
    if path.name == REPORT_FILES["plot"]:
        head = text.split("\n", 2)
        return (len(head) > 1 and head[0].startswith("<svg xmlns=")
                and f">sweep {html.escape(spec.name)}:" in head[1])
    return False


def write_report(path: Path, text: str, spec: SweepSpec) -> Path:
    """The one write of a sweep report: refused over anything but this sweep's own earlier report (a
    user's file of that name, a symlink, a FIFO, a device, apr's records), atomic, an OSError named."""
    if os.path.lexists(path) and not is_own_report(path, spec):
        raise SweepError(f"{path} is not a report of sweep {spec.name}; apr will not replace it", [Finding(
            "error", "sweep.folder_in_use", "not a report this sweep wrote; apr will not replace it", path="--dir",
            file=str(path), expected=f"no {path.name} but this sweep's own", got="another file")])
    check_output_file(path, overwrite=True, option="--dir")
    try:
        atomic_write_bytes(path, text.encode("utf-8"))
    except OSError as err:
        raise output_write_error(path, "--dir", err) from None
    return path
