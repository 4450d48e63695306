"""External tracker sinks (`monitoring.sinks`): the run's metric rows, also written to TensorBoard,
MLflow or Weights & Biases (offline), with the run's parameters (the resolved config as key paths
such as ``optimizer.lr``, the plan's key facts under ``plan.``, the run's figures under ``run.``).

Each sink lives on its own thread (``SinkWorker``): it is opened there and fed through a bounded
queue, so a slow, dead or silent tracking server never blocks a training step, the recorder's
state file or its stores. A sink that fails is closed and warned about once, naming it; one whose
call has not returned within its bound (``REMOTE_STALL_S`` for a tracking server, ``LOCAL_STALL_S``
for files) is warned about once and its rows wait in the queue (the oldest dropped, with a
warning, when it is full). At the end of the run a sink that is answering is waited for (at most
``CLOSE_WAIT_S``); one whose call has stalled is left behind at once, with a warning.

One run keeps one tracker run across resumes: TensorBoard logs to ``<dir>/<experiment>/<run_id>``,
and a resumed process purges events past its checkpoint's step before it appends (the steps the
killed process logged after it), so the curve has each step once; MLflow finds the run tagged
``apr.run_id`` in the experiment named like apr's and appends to it (its metric history cannot
delete: a step the stopped process logged after its checkpoint keeps both values, the later one
last; a param cannot change: a resume that changes one records the new value as the tag
``apr.changed.<key>``); W&B runs offline with the apr run id as its id, each process writing its
own offline folder that `wandb sync` joins into one run.

A sink never writes onto apr's own files or the data (``sink_target_problems``): validate, plan and
apply refuse such a ``dir`` or ``uri`` at its line, and a sink opened at run time checks again.
docs/runs.md ("Tracker sinks") is the user's page.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import os
import re
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from apr.config.schema import SinkConfig
from apr.errors import Finding
from apr.fsutil import is_apr_store
from apr.readers import file_kind
from apr.track.names import experiment_from_dir, global_db_path

EXTRA = "sinks"  # pip install 'apr[sinks]'
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # sink type -> its package

QUEUE_BATCHES = 256  # metric batches waiting per sink (the recorder hands one over every few seconds)
# How long a call into a tracker may take before it counts as stalled: (to open, any other call).
# Local files are only slow under load (MLflow creates its tables in a new SQLite store: ~20 s on a
# loaded 2-core machine); a tracking server that has not answered in 15 s is taken for dead.
LOCAL_STALL_S = (120.0, 60.0)
REMOTE_STALL_S = (15.0, 15.0)
CLOSE_WAIT_S = 300.0  # at the end of a run, the longest all sinks together are waited for

# MLflow's limits (mlflow.utils.validation): a param's value, a tag's value, a key, params per batch
MLFLOW_PARAM_VALUE_MAX = 6000
MLFLOW_TAG_VALUE_MAX = 8000
MLFLOW_KEY_MAX = 250
MLFLOW_PARAMS_PER_BATCH = 100
MLFLOW_METRICS_PER_BATCH = 1000

# apr's own files: the experiment stores (with SQLite's side files) and a run folder's records
STORE_FILES = ("experiments.db", "experiments.db-wal", "experiments.db-shm", "experiments.db-journal")
RECORD_FILES = ("training_state.json", "config.yaml", "plan.json", ".apr-run.lock")


def missing_package(sink_type: str) -> str | None:
    """The package a sink type needs when it is not installed (torch-free: a spec lookup)."""
    package = PACKAGES[sink_type]
    try:
        return None if importlib.util.find_spec(package) is not None else package
    except (ImportError, ValueError):
        return package


def sink_dir(sink: SinkConfig, output_dir: Path) -> Path:
    return Path(sink.dir) if sink.dir else Path(output_dir) / str(sink.type)


def mlflow_uri(sink: SinkConfig, output_dir: Path) -> str:
    return sink.uri or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def stall_limits(sink: SinkConfig, output_dir: Path) -> tuple[float, float]:
    """(seconds to open, seconds per call) before a sink's call counts as stalled: a tracking
    server's (an MLflow URI that is not a local file or folder) or local files'."""
    remote = str(sink.type) == "mlflow" and mlflow_local_target(mlflow_uri(sink, output_dir)) is None
    return REMOTE_STALL_S if remote else LOCAL_STALL_S


# ------------------------------------------------------------------------------ where sinks write

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def mlflow_local_target(uri: str) -> tuple[Path, str] | None:
    """The local file (``"file"``: a SQLite store) or folder (``"folder"``: MLflow's file store)
    an MLflow tracking URI writes; None for a server or a database elsewhere."""
    match = _SCHEME.match(uri)
    if match is None:
        return (Path(uri), "folder") if uri else None  # a plain path: MLflow's file store
    scheme = match.group(1).lower()
    rest = uri[match.end():]
    if scheme == "sqlite":
        if not rest.startswith("///"):
            return None  # sqlite:// is an in-memory database
        path = rest[3:].split("?", 1)[0]  # sqlite:////abs/path or sqlite:///relative/path
        return None if path in ("", ":memory:") else (Path(path), "file")
    if scheme == "file":
        path = rest[2:] if rest.startswith("//") else rest  # file:///abs, file:/abs, file:rel
        if path.startswith("localhost/"):
            path = path[len("localhost"):]
        return (Path(path), "folder") if path else None
    return None


SQLITE_HEADER = b"SQLite format 3\x00"


def local_target_problem(path: Path, kind: str) -> str | None:
    """Why a tracker cannot write its local ``file`` (a SQLite store) or ``folder`` here, found
    before the tracker opens it (MLflow retries a store it cannot open for ~100 s, and SQLite makes
    ``<file>-journal`` beside whatever it was given, a device included); None when it can."""
    path = Path(os.path.expanduser(str(path)))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"{path} cannot be examined: {e.strerror or e}"
    if st is not None:
        if kind == "file" and not stat_mod.S_ISREG(st.st_mode):
            return f"{path} is {file_kind(st.st_mode)}, not a SQLite file"
        if kind == "folder" and not stat_mod.S_ISDIR(st.st_mode):
            return f"{path} is {file_kind(st.st_mode)}, not a folder"
        if not os.access(path, os.R_OK | os.W_OK):
            return f"the folder {path} is read-only" if kind == "folder" else f"{path} is not writable"
        if kind == "file" and st.st_size:
            try:
                with open(path, "rb") as f:
                    head = f.read(len(SQLITE_HEADER))
            except OSError as e:
                return f"{path} cannot be read: {e.strerror or e}"
            if head != SQLITE_HEADER:
                return f"{path} is not a SQLite database"
    folder = path.parent if kind == "file" or st is None else path
    while not folder.exists() and folder != folder.parent:  # the tracker makes the missing folders
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is read-only" + (
            " (SQLite writes a journal beside its file)" if kind == "file" else "")
    return None


def _resolve(path: str | os.PathLike) -> Path:
    """As the run opens it: ``~`` expanded, relative to the current folder, symlinks followed."""
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _experiment(config) -> str:
    return config.monitoring.tracking.experiment or experiment_from_dir(Path(config.training.output_dir))


def sink_target_problems(config, *, apr_home: Path | None = None,
                         stores: Iterable[Path] = ()) -> list[tuple[str, str, str, str]]:
    """``(key path, message, expected, found)`` for every sink whose ``dir`` or ``uri`` would write
    onto apr's own files or the data: the run's store (``<output_dir>/.apr/``), the global
    registry (``$APR_HOME/experiments.db``, or ``apr_home``'s), any file named or shaped like an
    apr store, the run folder's records and checkpoints, or at or inside a training or validation
    data folder (or the tokenizer). ``stores``: more store files to protect (the recorder's own).
    Paths are taken as the run opens them (relative to the current folder, symlinks followed).
    Servers (``http://``, a database elsewhere) are not checked: they are not files here."""
    output_dir = _resolve(config.training.output_dir)
    own_store_dir = output_dir / ".apr"
    registry = _resolve(global_db_path(apr_home))
    store_files = {registry.parent / name for name in STORE_FILES} | {own_store_dir / n for n in STORE_FILES}
    for extra in stores:
        db = _resolve(extra)
        store_files |= {db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal")}
    data = config.data
    inputs = [(k, v) for k, v in (*data.train_paths(), *data.val_paths(), ("data.tokenizer", data.tokenizer)) if v]
    expected = "a folder or database of the tracker's own, apart from apr's records and the data"
    problems: list[tuple[str, str, str, str]] = []
    for i, sink in enumerate(config.monitoring.sinks):
        if str(sink.type) == "mlflow":
            if sink.uri is None:
                continue  # the default: <output_dir>/mlflow.db
            key, given = f"monitoring.sinks[{i}].uri", sink.uri
            local = mlflow_local_target(sink.uri)
            if local is None:
                continue
            path, kind = local
            writes = [_resolve(path)]
        else:
            if sink.dir is None:
                continue  # the default: <output_dir>/<type>
            key, given, kind = f"monitoring.sinks[{i}].dir", sink.dir, "folder"
            root = _resolve(sink.dir)
            # where the files land: TensorBoard <dir>/<experiment>/<run_id>, W&B <dir>/wandb/
            writes = [root, root / (_experiment(config) if str(sink.type) == "tensorboard" else "wandb")]
        target = writes[0]
        what = "file" if kind == "file" else "folder"
        lead = f"the {sink.type} sink's {key.rsplit('.', 1)[1]} {given!r} would write"
        refuse = _refusal(problems, key, lead, expected)
        exists_as = _node_kind(target)
        if any(_within(w, own_store_dir) for w in writes):
            refuse(f"into the run's own experiment store ({own_store_dir})", f"{target}, inside {own_store_dir}")
        elif any(w in store_files for w in writes) or (kind == "file" and target.name in STORE_FILES):
            refuse("onto an apr experiment store", f"{target} (an apr experiment store)")
        elif kind == "file" and is_apr_store(target, unreadable=True):
            refuse("into an apr experiment store", f"{target} (a SQLite file with apr's runs table)")
        elif _within(target, output_dir) and target != output_dir and (
                target.relative_to(output_dir).parts[0] in RECORD_FILES
                or target.relative_to(output_dir).parts[0].startswith("checkpoint-")):
            part = target.relative_to(output_dir).parts[0]
            refuse(f"onto the run's records ({part} in {output_dir})", f"{target} (apr's {part})")
        elif exists_as is not None and exists_as != ("a regular file" if kind == "file" else "a directory"):
            refuse(f"into {exists_as}", f"{target} ({exists_as})")  # a device, a FIFO: never opened
        else:
            for data_key, value in inputs:
                source = _resolve(value)
                hit = next((w for w in writes if _within(w, source)), None)
                if hit is not None:
                    how = "at" if hit == source else "inside"
                    refuse(f"{how} {data_key} ({value}): its files would become data or overwrite it",
                           f"{what} {hit}, {how} {source}")
                    break
    return problems


def _node_kind(path: Path) -> str | None:
    """What is at ``path`` (``a regular file``, ``a directory``, ``a FIFO (named pipe)``...); None
    when nothing is, or it cannot be examined."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return "a regular file" if stat_mod.S_ISREG(mode) else file_kind(mode)


def _refusal(problems: list, key: str, lead: str, expected: str) -> Callable[[str, str], None]:
    def refuse(why: str, found: str) -> None:
        problems.append((key, f"{lead} {why}; point it elsewhere (or leave it out: the default is inside "
                              "the run's folder)", expected, found))

    return refuse


def sink_target_findings(loaded, *, apr_home: Path | None = None) -> list:
    """``sink_target_problems`` as error findings at the sink's line (code ``config.sink_target``),
    for validate, plan and apply (which refuses a plan with errors before writing anything)."""
    out = []
    for key, message, expected, got in sink_target_problems(loaded.config, apr_home=apr_home):
        index = int(key.split("[", 1)[1].split("]", 1)[0])
        file, line, column = loaded.source.where(("monitoring", "sinks", index, key.rsplit(".", 1)[1]))
        out.append(Finding("error", "config.sink_target", message, path=key, file=file, line=line, column=column,
                           expected=expected, got=got))
    return out


# ------------------------------------------------------------------------------- the run's params

# The plan's key facts every tracker gets, as plan.<name>: (name, path in the plan document)
PLAN_FACTS = (
    ("params", ("facts", "model", "params")),
    ("trainable_params", ("facts", "model", "trainable_params")),
    ("non_embedding_params", ("facts", "model", "non_embedding_params")),
    ("flops_per_token", ("facts", "model", "flops_per_token")),
    ("total_steps", ("facts", "steps", "total_steps")),
    ("total_tokens", ("facts", "steps", "total_tokens")),
    ("tokens_per_step", ("facts", "steps", "tokens_per_step")),
    ("sequences_per_step", ("facts", "steps", "sequences_per_step")),
    ("steps_per_epoch", ("facts", "steps", "steps_per_epoch")),
    ("epochs_run", ("facts", "steps", "epochs_run")),
    ("train_sequences", ("facts", "steps", "num_sequences")),
    ("tokens_per_param", ("facts", "steps", "tokens_per_param")),
    ("world_size", ("world_size",)),
    ("nodes", ("nodes",)),
    ("engine", ("facts", "execution", "engine")),
    ("device", ("facts", "execution", "device_resolved")),
    ("kernels", ("facts", "execution", "kernels_resolved")),
    ("precision", ("facts", "execution", "precision")),
    ("clip", ("facts", "execution", "clip")),
    ("execution.activations", ("facts", "execution", "policy", "activations")),
    ("execution.gradients", ("facts", "execution", "policy", "gradients")),
    ("execution.cost", ("facts", "execution", "policy_cost")),
    ("execution.strategy", ("facts", "execution", "strategy")),
    ("sharding", ("facts", "sharding", "strategy")),
    ("memory_bytes", ("facts", "memory", "total_bytes")),
    ("target", ("target", "label")),
    ("budget_bytes", ("target", "vram_bytes")),
    ("threads", ("facts", "threads", "threads")),
    ("estimated_seconds", ("time_estimate", "estimated_seconds")),
    ("config_hash", ("config_hash",)),
    ("apr_version", ("apr_version",)),
)


def _flatten(doc: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(doc, dict) and doc:
        for key, value in doc.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(doc, (dict, list, tuple)):
        out[prefix] = json.dumps(doc, sort_keys=True, default=str)  # lists (alerts, sinks...) as JSON text
    else:
        out[prefix] = doc


def _dig(doc: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(part)
    return doc


def run_params(config_doc: dict, plan_doc: dict | None = None, run: dict | None = None) -> dict[str, Any]:
    """The params every tracker gets: the resolved config flattened to key paths (``optimizer.lr``;
    lists as JSON text), the plan's key facts as ``plan.<name>`` (``PLAN_FACTS``, those it has) and
    the run's own figures as ``run.<name>``. Values stay scalars (or None); each sink writes them
    as its tool expects."""
    out: dict[str, Any] = {}
    _flatten(config_doc, "", out)
    for name, path in PLAN_FACTS if plan_doc else ():
        value = _dig(plan_doc, path)
        if value is not None and not isinstance(value, (dict, list)):
            out[f"plan.{name}"] = value
    for name, value in (run or {}).items():
        out[f"run.{name}"] = value
    return out


def param_text(value: Any) -> str:
    """A param as text: strings as they are, numbers as Python prints them, true/false/null."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, sort_keys=True, default=str)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    mark = f"...[{len(text):,} chars]"
    return text[: limit - len(mark)] + mark


def _mlflow_key(key: str) -> str:
    """A key MLflow accepts: alphanumerics, _ - . space / : only, at most 250 characters."""
    return re.sub(r"[^/\w.\- :]", "_", key)[:MLFLOW_KEY_MAX]


# ------------------------------------------------------------------------------------ the sinks

class TensorBoardSink:
    """Scalars under their apr metric names (``loss``, ``lr``, ``val_loss``, ``eval.<task>.acc`` ...);
    the params as TensorBoard hparams of the same run and as a text table (``apr/params``)."""

    def __init__(self, root: Path, experiment: str, run_id: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is an optional extra

        self.log_dir = Path(root) / experiment / run_id
        self.step0 = 0 if resume_step is None else max(int(resume_step), 0)
        # purge_step: events of this run at or after the step it resumes from are hidden, as the
        # stores drop metrics recorded after the checkpoint
        self.writer = SummaryWriter(log_dir=str(self.log_dir),
                                    purge_step=None if resume_step is None else int(resume_step) + 1)

    def log_params(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        values = {k: v if isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not math.isfinite(v))
                  else param_text(v) for k, v in params.items()}
        # written into this run (SummaryWriter.add_hparams would start a run of its own)
        for summary in hparams(values, {"loss": 0.0, "val_loss": 0.0}):
            self.writer.file_writer.add_summary(summary, global_step=self.step0)
        table = "| param | value |\n|---|---|\n" + "\n".join(
            f"| {k} | {param_text(v).replace('|', '&#124;')} |" for k, v in params.items())
        self.writer.add_text("apr/params", table, global_step=self.step0)
        self.writer.flush()

    def write(self, rows: list[tuple]) -> None:
        for _run_id, step, key, value, t in rows:
            if value is not None:
                self.writer.add_scalar(key, value, global_step=int(step), walltime=t)
        self.writer.flush()

    def close(self, status: str | None = None) -> None:
        self.writer.close()


class MlflowSink:
    """Metrics and params of one MLflow run (tagged ``apr.run_id``) in the experiment named like apr's."""

    def __init__(self, uri: str, experiment: str, run_id: str, create: bool | None = None):
        """Find the run tagged ``apr.run_id`` (``existed``) or create it; ``create`` True: an
        existing one is deleted and made anew (a re-export)."""
        local = mlflow_local_target(uri)
        problem = local_target_problem(*local) if local is not None else None
        if problem is not None:  # before MLflow retries it for ~100 s, or SQLite writes a journal beside it
            raise OSError(f"the MLflow store {uri!r} cannot be written: {problem}")
        from mlflow import MlflowClient  # lazy: mlflow is an optional extra

        for name in ("mlflow", "alembic"):  # their INFO lines (creating tables...) are not the run's output
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`apr.run_id` = '{run_id}'", max_results=1)
        self.existed = bool(found)
        if found and create:
            self.client.delete_run(found[0].info.run_id)
            found = []
        if found:
            self.run_id = found[0].info.run_id
            if create is None:
                self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run_id, tags={"apr.run_id": run_id}).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        """Params within MLflow's limits (keys cleaned and cut to 250 characters, values to 6,000,
        100 per batch). A param the run already has keeps its first value (MLflow refuses a
        change): a different value now is recorded as the tag ``apr.changed.<key>``."""
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(self.run_id).data.params
        new: dict[str, str] = {}
        changed: dict[str, str] = {}
        for key, value in params.items():
            name = _mlflow_key(key)
            text = param_text(value)
            if name not in existing:
                new[name] = _clip(text, MLFLOW_PARAM_VALUE_MAX)
            elif existing[name] != _clip(text, MLFLOW_PARAM_VALUE_MAX):
                changed[_mlflow_key(f"apr.changed.{key}")] = _clip(text, MLFLOW_TAG_VALUE_MAX)
        items = list(new.items())
        for i in range(0, len(items), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i:i + MLFLOW_PARAMS_PER_BATCH]])
        tags = list(changed.items())
        for i in range(0, len(tags), MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags[i:i + MLFLOW_PARAMS_PER_BATCH]])

    def write(self, rows: list[tuple]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key.replace("@", "_"), float(value), int(t * 1000), int(step))
                   for _run_id, step, key, value, t in rows if value is not None]
        for i in range(0, len(metrics), MLFLOW_METRICS_PER_BATCH):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_METRICS_PER_BATCH])

    def close(self, status: str | None = None) -> None:
        """End the MLflow run with apr's final status (finished, stopped, failed)."""
        mapped = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}.get(status or "", "FINISHED")
        self.client.set_terminated(self.run_id, status=mapped)


class WandbSink:
    """An offline W&B run with the apr run id as its id (``wandb sync DIR/wandb/offline-run-*`` uploads
    it); the params are its config, under their key paths."""

    def __init__(self, root: Path, experiment: str, run_id: str):
        import wandb  # lazy: wandb is an optional extra

        Path(root).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(root), project=experiment, id=run_id, name=run_id,
                              resume="allow", settings=wandb.Settings(silent=True, console="off"))
        self.step = -1

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def write(self, rows: list[tuple]) -> None:
        by_step: dict[int, dict] = {}
        for _run_id, step, key, value, _t in rows:
            if value is not None:
                by_step.setdefault(int(step), {})[key] = value
        for step in sorted(by_step):
            if step < self.step:  # W&B steps only go forward; apr logs in step order, so this is a resume overlap
                continue
            self.run.log(by_step[step], step=step)
            self.step = step

    def close(self, status: str | None = None) -> None:
        import wandb  # lazy: wandb is an optional extra

        self.run.finish(exit_code=0 if status in (None, "finished") else 1)
        # finish() can return before wandb's service process has written the last records to the
        # offline file (seen on a loaded CI machine: a resumed run's history missing); teardown
        # waits for the service to flush and exit, so the file is complete when apply returns.
        wandb.teardown()


def open_sink(sink: SinkConfig, output_dir: Path, experiment: str, run_id: str, resume_step: int | None):
    if str(sink.type) == "tensorboard":
        return TensorBoardSink(sink_dir(sink, output_dir), experiment, run_id, resume_step)
    if str(sink.type) == "mlflow":
        return MlflowSink(mlflow_uri(sink, output_dir), experiment, run_id)
    if str(sink.type) == "wandb":
        return WandbSink(sink_dir(sink, output_dir), experiment, run_id)
    raise ValueError(f"unknown sink type {sink.type}")


# ------------------------------------------------------------------------- one sink, one thread

class SinkWorker:
    """One tracker on its own daemon thread: ``open_tracker()`` runs there, then the params and the
    metric batches handed to ``submit``, in order. The caller never waits on the tracker (it only
    takes a lock briefly). ``warn(message)`` is called once per kind of trouble, the sink's label
    first, for the first trouble only: the tracker raised (it is closed and takes no more rows), a
    call has not returned within its bound (``limits``: seconds to open, seconds per other call; its
    rows wait), the queue overflowed (the oldest batches are dropped), or it was left behind at the
    end of the run."""

    def __init__(self, label: str, open_tracker: Callable[[], Any], warn: Callable[[str], None],
                 params: dict[str, Any] | None = None, limits: tuple[float, float] = LOCAL_STALL_S):
        self.label = label
        self.open_limit, self.call_limit = limits
        self._open = open_tracker
        self._warn = warn
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        if params:
            self._queue.append(("params", params))
        self._closing: str | None = None
        self._close_requested = False
        self.failed = False
        self._busy_since: float | None = None  # when the call in flight began (time.monotonic)
        self._busy_what = "starting"
        self._busy_limit = self.open_limit
        self._warned: set[str] = set()
        self.dropped_batches = 0
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"apr-sink-{label}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller's side (any thread)

    def submit(self, rows: list[tuple]) -> None:
        """Queue one batch of metric rows (ignored once the sink has failed or is closing)."""
        with self._cv:
            messages = self._stall_warning()
            if not (self.failed or self._close_requested or not rows):
                if sum(1 for kind, _ in self._queue if kind == "metrics") >= QUEUE_BATCHES:
                    oldest = next(i for i, (kind, _) in enumerate(self._queue) if kind == "metrics")
                    del self._queue[oldest]
                    self.dropped_batches += 1
                    messages += self._once("full", f"{QUEUE_BATCHES} metric batches are waiting for it; the "
                                                   "oldest are dropped (apr's stores keep every row)")
                self._queue.append(("metrics", list(rows)))
                self._cv.notify_all()
        self._emit(messages)

    def stalled(self) -> bool:
        """Whether the call in flight has run past its bound (``limits``)."""
        with self._cv:
            return self._stalled_locked()

    def request_close(self, status: str | None) -> None:
        """Ask the thread to write what is queued, then close the tracker with apr's final status."""
        with self._cv:
            if not self._close_requested:
                self._close_requested = True
                self._closing = status
                self._cv.notify_all()

    def wait(self, deadline: float) -> bool:
        """Wait for the thread to finish: until it has, until ``deadline`` (time.monotonic), or until
        its call in flight runs past its bound (a tracker that answers slowly is waited for; one
        that does not answer is not). A sink left behind is warned about; True when it finished."""
        while not self.done.wait(0.05):
            if time.monotonic() >= deadline or self.stalled():
                with self._cv:
                    what = self._busy_what
                    self.failed = True
                    self._queue.clear()
                self._emit(self._once("close", f"still {what} when the run ended; left behind, so its last "
                                               "rows may be missing from it"))
                return False
        return True

    def close(self, status: str | None, timeout: float | None = None) -> bool:
        self.request_close(status)
        return self.wait(time.monotonic() + (CLOSE_WAIT_S if timeout is None else timeout))

    # ---------------------------------------------------------------------------- the thread

    def _stalled_locked(self) -> bool:
        return self._busy_since is not None and time.monotonic() - self._busy_since >= self._busy_limit

    def _stall_warning(self) -> list[str]:
        if not self._stalled_locked():
            return []
        return self._once("stall", f"no answer for {self._busy_limit:g} s while {self._busy_what}; training "
                                   f"continues without waiting for it (its rows wait, up to {QUEUE_BATCHES} "
                                   "batches, and are dropped if it has not answered when the run ends)")

    def _once(self, kind: str, text: str) -> list[str]:
        """The warning text of this sink's first trouble; later ones (a stall that ends in a failure,
        a queue that overflows because it stalled) are not repeated (caller holds the lock)."""
        if self._warned:
            return []
        self._warned.add(kind)
        return [f"{self.label} sink: {text}"]

    def _emit(self, messages: list[str]) -> None:
        for message in messages:
            try:
                self._warn(message)
            except Exception:
                pass

    def _call(self, what: str, fn: Callable[[], Any], limit: float) -> Any:
        with self._cv:
            self._busy_since, self._busy_what, self._busy_limit = time.monotonic(), what, limit
        try:
            return fn()
        finally:
            with self._cv:
                self._busy_since = None

    def _fail(self, error: BaseException, what: str, tracker: Any) -> None:
        with self._cv:
            already = self.failed
            self.failed = True
            self._queue.clear()
            messages = [] if already else self._once(
                "failed", f"{type(error).__name__} while {what}: {error}; training continues without it")
        self._emit(messages)
        if tracker is not None:
            try:
                tracker.close("failed")
            except Exception:
                pass

    def _run(self) -> None:
        tracker = None
        try:
            try:
                tracker = self._call("opening the run", self._open, self.open_limit)
            except Exception as e:  # a missing package, an unwritable folder, a refused target, no server
                self._fail(e, "opening the run", None)
                return
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._queue or self._close_requested or self.failed)
                    if self.failed:
                        return
                    if not self._queue:
                        status = self._closing
                        break
                    kind, payload = self._queue.popleft()
                what = "writing params" if kind == "params" else "writing metrics"
                method = tracker.log_params if kind == "params" else tracker.write
                try:
                    self._call(what, lambda m=method, p=payload: m(p), self.call_limit)
                except Exception as e:
                    self._fail(e, what, tracker)
                    return
            try:
                self._call("closing the run", lambda: tracker.close(status), self.call_limit)
            except Exception as e:
                self._fail(e, "closing the run", None)
        finally:
            self.done.set()


def close_workers(workers: list[SinkWorker], status: str | None, timeout: float | None = None) -> None:
    """Close every sink at once (they drain in parallel) and wait for them: at most ``timeout``
    (default ``CLOSE_WAIT_S``) seconds in all, and not for one whose call has run past its bound."""
    deadline = time.monotonic() + (CLOSE_WAIT_S if timeout is None else timeout)
    for worker in workers:
        worker.request_close(status)
    for worker in workers:
        worker.wait(deadline)
