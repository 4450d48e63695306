"""External tracker sinks (`monitoring.sinks`): the run's metric rows, also written to TensorBoard,
MLflow or Weights & Biases (offline).

The recorder hands each sink the same rows it writes to its SQLite stores, on its background
thread (apr/track/recorder.py), so a slow or broken tracker never blocks a step; a sink that
fails is closed, warned about once, and the run goes on. One run keeps one tracker run across
resumes: TensorBoard logs to ``<dir>/<experiment>/<run_id>``, and a resumed process purges events
past its checkpoint's step before it appends (the steps the killed process logged after it), so
the curve has each step once; MLflow finds the run tagged ``apr.run_id`` in the experiment named
like apr's and appends to it (its metric history cannot delete: a step the stopped process logged
after its checkpoint keeps both values, the later one last); W&B runs offline with the apr run id
as its id, each process writing its own offline folder that `wandb sync` joins into one run.
docs/runs.md ("Tracker sinks") is the user's page.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from apr.config.schema import SinkConfig

EXTRA = "sinks"  # pip install 'apr[sinks]'
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}  # sink type -> its package


def missing_package(sink_type: str) -> str | None:
    """The package a sink type needs when it is not installed (torch-free: a spec lookup)."""
    package = PACKAGES[sink_type]
    try:
        return None if importlib.util.find_spec(package) is not None else package
    except (ImportError, ValueError):
        return package


def sink_dir(sink: SinkConfig, output_dir: Path) -> Path:
    return Path(sink.dir) if sink.dir else Path(output_dir) / str(sink.type)


class TensorBoardSink:
    """Scalars under their apr metric names (``loss``, ``lr``, ``val_loss``, ``eval.<task>.acc`` ...)."""

    def __init__(self, root: Path, experiment: str, run_id: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is an optional extra

        self.log_dir = Path(root) / experiment / run_id
        # purge_step: events of this run at or after the step it resumes from are hidden, as the
        # stores drop metrics recorded after the checkpoint
        self.writer = SummaryWriter(log_dir=str(self.log_dir),
                                    purge_step=None if resume_step is None else int(resume_step) + 1)

    def write(self, rows: list[tuple]) -> None:
        for _run_id, step, key, value, t in rows:
            if value is not None:
                self.writer.add_scalar(key, value, global_step=int(step), walltime=t)
        self.writer.flush()

    def close(self, status: str | None = None) -> None:
        self.writer.close()


class MlflowSink:
    """Metrics of one MLflow run (tagged ``apr.run_id``) in the experiment named like apr's."""

    def __init__(self, uri: str, experiment: str, run_id: str, create: bool | None = None):
        """Find the run tagged ``apr.run_id`` (``existed``) or create it; ``create`` True: an
        existing one is deleted and made anew (a re-export)."""
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

    def write(self, rows: list[tuple]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key.replace("@", "_"), float(value), int(t * 1000), int(step))
                   for _run_id, step, key, value, t in rows if value is not None]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str | None = None) -> None:
        """End the MLflow run with apr's final status (finished, stopped, failed)."""
        mapped = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}.get(status or "", "FINISHED")
        self.client.set_terminated(self.run_id, status=mapped)


class WandbSink:
    """An offline W&B run with the apr run id as its id (``wandb sync DIR/wandb/offline-run-*`` uploads it)."""

    def __init__(self, root: Path, experiment: str, run_id: str):
        import wandb  # lazy: wandb is an optional extra

        Path(root).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(root), project=experiment, id=run_id, name=run_id,
                              resume="allow", settings=wandb.Settings(silent=True, console="off"))
        self.step = -1

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


def mlflow_uri(sink: SinkConfig, output_dir: Path) -> str:
    return sink.uri or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def open_sink(sink: SinkConfig, output_dir: Path, experiment: str, run_id: str, resume_step: int | None):
    if str(sink.type) == "tensorboard":
        return TensorBoardSink(sink_dir(sink, output_dir), experiment, run_id, resume_step)
    if str(sink.type) == "mlflow":
        return MlflowSink(mlflow_uri(sink, output_dir), experiment, run_id)
    if str(sink.type) == "wandb":
        return WandbSink(sink_dir(sink, output_dir), experiment, run_id)
    raise ValueError(f"unknown sink type {sink.type}")
