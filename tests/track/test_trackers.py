"""monitoring.sinks: a real (tiny, CPU) run's metrics reach TensorBoard, read back by tensorboard's
own EventAccumulator; a resume appends to the same TensorBoard run; a sink that fails is a warning;
a missing package is a validate/plan error naming the extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.apply import run_apply
from apr.cli.main import app
from apr.track import trackers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402

pytest.importorskip("tensorboard", reason="the sinks extra (tensorboard) is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _hparams(log_dir: Path) -> dict:
    """The params of a TensorBoard run as its hparams plugin stores them (the latest session)."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in hparams.items()}


def _params_text(log_dir: Path) -> str:
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return tensor_util.make_ndarray(acc.Tensors("apr/params/text_summary")[-1].tensor_proto).item().decode()


def _plan_facts(run_dir: Path) -> dict:
    return json.loads((run_dir / "plan.json").read_text())["facts"]


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def _same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """The same steps, and values equal to TensorBoard's float32."""
    return [s for s, _ in got] == [s for s, _ in want] and [v for _, v in got] == pytest.approx(
        [v for _, v in want], rel=1e-6)


def _state(run_dir: Path) -> dict:
    return json.loads((run_dir / "training_state.json").read_text())


def _history(state: dict, key: str) -> list[tuple[int, float]]:
    return [(int(s), v) for s, v in state[f"{key}_history"]]


def test_a_run_writes_every_logged_metric_to_tensorboard_and_a_resume_appends(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 12, "eval_interval": 4, "save_interval": 2},
                       monitoring={"tracking": {"experiment": "tb"}, "sinks": [{"type": "tensorboard"}]})
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    first = run_apply(cfg, settings=["training.max_steps=6"], **quiet)
    assert first.status == "finished"
    log_dir = tmp_path / "run" / "tensorboard" / "tb" / first.run_id
    assert _same(_scalars(log_dir, "loss"), _history(_state(tmp_path / "run"), "loss"))
    facts = _plan_facts(tmp_path / "run")
    hp = _hparams(log_dir)  # the resolved config as key paths, the plan's key facts, the run's figures
    assert hp["optimizer.lr"] == pytest.approx(1e-2) and hp["training.max_steps"] == 6
    assert hp["model.architecture.hidden_size"] == 32 and hp["data.val"] == str(tmp_path / "data" / "val")
    assert hp["plan.params"] == facts["model"]["params"] and hp["plan.world_size"] == 1
    assert hp["plan.total_steps"] == 6
    assert hp["plan.execution.activations"] == facts["execution"]["policy"]["activations"]
    assert hp["run.id"] == first.run_id
    assert "| optimizer.lr | 0.01 |" in _params_text(log_dir)
    resumed = run_apply(cfg, resume="latest", **quiet)  # max_steps back to 12: the same run goes on
    assert resumed.status == "finished" and resumed.run_id == first.run_id and resumed.final_step == 12
    loss = _scalars(log_dir, "loss")
    expected = _history(_state(tmp_path / "run"), "loss")
    assert _same(loss, expected) and len({s for s, _ in loss}) == len(loss) and loss[-1][0] == 12
    val = _scalars(log_dir, "val_loss")
    assert _same(val, _history(_state(tmp_path / "run"), "val_loss"))
    assert [s for s, _ in val] == [0, 4, 6, 8, 12]  # the first run ended (and evaluated) at 6
    assert list((tmp_path / "run" / "tensorboard" / "tb").iterdir()) == [log_dir]  # one TensorBoard run
    # hparams keep the first session's values (one session per TensorBoard run); the text table of
    # the params is written by every session, at the step it starts from
    assert _hparams(log_dir)["training.max_steps"] == 6
    assert "| training.max_steps | 12 |" in _params_text(log_dir)


def test_mlflow_gets_the_same_metrics_in_one_run_across_a_resume(tmp_path):
    pytest.importorskip("mlflow", reason="the sinks extra (mlflow-skinny) is not installed")
    from mlflow import MlflowClient

    make_dataset(tmp_path)
    uri = f"sqlite:///{tmp_path / 'ml.db'}"
    cfg = write_config(tmp_path, training={"max_steps": 12, "eval_interval": 4, "save_interval": 2},
                       monitoring={"tracking": {"experiment": "mlf"}, "sinks": [{"type": "mlflow", "uri": uri}]})
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    first = run_apply(cfg, settings=["training.max_steps=6"], **quiet)
    resumed = run_apply(cfg, resume="latest", **quiet)
    assert resumed.status == "finished" and resumed.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("mlf")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["apr.run_id"] == first.run_id and run.info.status == "FINISHED"
    state = _state(tmp_path / "run")
    for key in ("loss", "val_loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert _same(history, _history(state, key)), key
    params, facts = run.data.params, _plan_facts(tmp_path / "run")
    assert params["optimizer.lr"] == "0.01" and params["model.architecture.num_hidden_layers"] == "2"
    assert params["monitoring.sinks"] == json.dumps([{"dir": None, "type": "mlflow", "uri": uri}])
    assert params["plan.params"] == str(facts["model"]["params"]) and params["plan.world_size"] == "1"
    assert params["plan.total_tokens"] == "384"  # 6 steps x 64 tokens: the first session's plan
    assert run.data.tags["apr.changed.plan.total_tokens"] == str(facts["steps"]["total_tokens"]) == "768"
    assert params["plan.execution.gradients"] == facts["execution"]["policy"]["gradients"]
    assert params["run.id"] == first.run_id
    # MLflow keeps a param's first value: the resume's max_steps is a tag
    assert params["training.max_steps"] == "6" and run.data.tags["apr.changed.training.max_steps"] == "12"
    _mlflow_params_respect_the_value_length_and_batch_limits(uri)


def _wandb_history(run_file: Path, config: dict | None = None) -> list[dict]:
    """History rows of a W&B offline run file, read with wandb's own record protobuf (its config
    updates into ``config``). The file is a LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB
    blocks of CRC/length/type framed chunks); wandb ships no reader for it since its core moved to Go."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, rows = run_file.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "config" and config is not None:
                for item in record.config.update:
                    config[item.key or ".".join(item.nested_key)] = json.loads(item.value_json)
            if record.WhichOneof("record_type") == "history":
                rows.append({"_step": record.history.step.num,
                             **{i.key or ".".join(i.nested_key): json.loads(i.value_json)
                                for i in record.history.item}})
    return rows


def test_wandb_offline_gets_the_same_metrics_under_the_apr_run_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the sinks extra (wandb) is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 12, "eval_interval": 4, "save_interval": 2},
                       monitoring={"tracking": {"experiment": "wb"}, "sinks": [{"type": "wandb"}]})
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    first = run_apply(cfg, settings=["training.max_steps=6"], **quiet)
    resumed = run_apply(cfg, resume="latest", **quiet)
    assert resumed.status == "finished" and resumed.run_id == first.run_id
    files = sorted((tmp_path / "run" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{first.run_id}.wandb" for f in files)  # one W&B run id
    seen: dict[int, dict] = {}
    per_file = []
    config: dict = {}
    for f in files:
        rows = _wandb_history(f, config)
        per_file.append((f.parent.name, f.stat().st_size, [r["_step"] for r in rows]))
        for row in rows:
            seen.setdefault(int(row["_step"]), {}).update(row)
    state = _state(tmp_path / "run")
    for key in ("loss", "val_loss"):
        got = [(s, r[key]) for s, r in sorted(seen.items()) if key in r]
        assert _same(got, _history(state, key)), (key, per_file, state.get("store_warnings"))
    facts = _plan_facts(tmp_path / "run")
    assert config["optimizer.lr"] == pytest.approx(1e-2)
    assert config["training.max_steps"] == 12  # the resumed session's value
    assert config["plan.params"] == facts["model"]["params"] and config["plan.world_size"] == 1
    assert config["plan.execution.activations"] == facts["execution"]["policy"]["activations"]


def test_a_sink_that_cannot_write_is_a_warning_and_the_run_finishes(tmp_path, capsys):
    make_dataset(tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the sink wants a folder\n")
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000},
                       monitoring={"sinks": [{"type": "tensorboard", "dir": str(blocker / "tb")}]})
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
    assert result.status == "finished" and result.exit_code == 0
    (warning,) = [w for w in _state(tmp_path / "run")["store_warnings"] if "tensorboard sink" in w]
    assert "continues without it" in warning
    assert f"apr: warning: {warning}" in capsys.readouterr().err


def test_a_missing_tracker_package_is_an_error_at_the_sinks_line(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, monitoring={"sinks": [{"type": "tensorboard"}]})
    monkeypatch.setitem(trackers.PACKAGES, "tensorboard", "no_such_package_for_apr_tests")
    runner = CliRunner()
    for command in ("validate", "plan"):
        r = runner.invoke(app, ["train", command, str(cfg), "--json"])
        assert r.exit_code == 1, r.output
        (f,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.sink_package"]
        assert f["path"] == "monitoring.sinks[0].type" and "apr[sinks]" in f["message"]
        assert f["line"] == next(i for i, line in enumerate(cfg.read_text().splitlines(), 1) if "tensorboard" in line)


def test_an_unknown_sink_type_is_refused_by_validate(tmp_path):
    make_dataset(tmp_path)
    for sink, path in (({"type": "neptune"}, "monitoring.sinks[0].type"),
                       ({"type": "tensorboard", "uri": "sqlite:///x.db"}, "monitoring.sinks[0]"),
                       ({"type": "mlflow", "dir": "x"}, "monitoring.sinks[0]")):
        cfg = write_config(tmp_path, monitoring={"sinks": [sink]})
        r = CliRunner().invoke(app, ["train", "validate", str(cfg), "--json"])
        assert r.exit_code == 1 and json.loads(r.stdout)["findings"][0]["path"] == path


def test_experiment_export_to_tensorboard_and_mlflow_writes_a_recorded_run(tmp_path):
    pytest.importorskip("mlflow", reason="the sinks extra (mlflow-skinny) is not installed")
    from mlflow import MlflowClient

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 6, "eval_interval": 3, "save_interval": 1000},
                       monitoring={"tracking": {"experiment": "old"}})
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
    expected = _history(_state(tmp_path / "run"), "loss")
    runner = CliRunner()
    db = str(tmp_path / "run")
    for again in ([], ["--overwrite"]):  # a second export replaces the first only with --overwrite
        r = runner.invoke(app, ["experiment", "export", "--db", db, "--to", "tensorboard",
                                "--out", str(tmp_path / "tb"), *again])
        assert r.exit_code == 0, r.output
        skipped = runner.invoke(app, ["experiment", "export", "--db", db, "--to", "tensorboard",
                                      "--out", str(tmp_path / "tb")])
        assert "skipped, already in" in skipped.stdout, skipped.output
        assert _same(_scalars(tmp_path / "tb" / "old" / result.run_id, "loss"), expected)
    ml = tmp_path / "ml.db"
    args = ["experiment", "export", "--db", db, "--run", result.run_id, "--to", "mlflow", "--out", str(ml)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "metric points" in r.stdout, r.output
    assert "skipped, already in" in runner.invoke(app, args).stdout
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{ml}")
    (run,) = client.search_runs([client.get_experiment_by_name("old").experiment_id])
    assert run.info.status == "FINISHED"
    assert _same(sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")), expected)
    bad = runner.invoke(app, ["experiment", "export", "--db", db, "--to", "tensorboard", "--format", "csv",
                              "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2


class _SilentServer:
    """A loopback TCP server that accepts every connection and never answers (a hung tracking server)."""

    def __init__(self):
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)  # kept open, never read, never answered
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_tracking_server_that_never_answers_does_not_hold_the_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow", reason="the sinks extra (mlflow-skinny) is not installed")
    # a server is taken for dead after this long without an answer (15 s by default)
    monkeypatch.setattr(trackers, "REMOTE_STALL_S", (0.5, 0.5))
    server = _SilentServer()
    try:
        make_dataset(tmp_path)
        cfg = write_config(tmp_path, training={"max_steps": 8, "log_interval": 1, "eval_interval": 4,
                                               "save_interval": 4},
                           monitoring={"sinks": [{"type": "mlflow", "uri": f"http://127.0.0.1:{server.port}"}]})
        result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
        _until(lambda: server.accepted >= 1, "the sink never reached the server")  # which never answered
    finally:
        server.close()
    # every step trained and was recorded although the sink never opened
    assert result.status == "finished" and result.exit_code == 0 and result.final_step == 8
    state = _state(tmp_path / "run")
    assert [s for s, _ in _history(state, "loss")] == list(range(1, 9)) and state["status"] == "finished"
    (warning,) = [w for w in state["store_warnings"] if w.startswith("mlflow sink:")]  # once, naming it
    assert "opening the run" in warning  # stalled while training, or still opening when the run ended
    assert f"apr: warning: {warning}" in capsys.readouterr().err
    assert (tmp_path / "run" / ".apr" / "experiments.db").exists()  # apr's own stores were written


class _Tracker:
    """A fake tracker: records what it is given; ``gate`` (an Event) holds every write until set."""

    def __init__(self, gate=None, fail_on_write: bool = False):
        import threading

        self.gate, self.fail_on_write = gate, fail_on_write
        self.params: list[dict] = []
        self.rows: list[list] = []
        self.closed: list = []
        self.writing = threading.Event()

    def log_params(self, params: dict) -> None:
        self.params.append(params)

    def write(self, rows: list) -> None:
        self.writing.set()
        if self.fail_on_write:
            raise OSError("disk full")
        if self.gate is not None:
            self.gate.wait()
        self.rows.append(rows)

    def close(self, status=None) -> None:
        self.closed.append(status)


def _until(predicate, what: str) -> None:
    """Wait for a background thread to get somewhere (not a timing assertion: the bound is generous)."""
    import time

    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_sink_worker_sends_params_then_rows_in_order_and_closes_with_the_runs_status():
    tracker, warnings = _Tracker(), []
    worker = trackers.SinkWorker("fake", lambda: tracker, warnings.append, params={"optimizer.lr": 0.01})
    batches = [[("r", step, "loss", 1.0 / step, 0.0)] for step in range(1, 6)]
    for batch in batches:
        worker.submit(batch)
    assert worker.close("stopped", timeout=60)
    assert tracker.params == [{"optimizer.lr": 0.01}] and tracker.rows == batches
    assert tracker.closed == ["stopped"] and warnings == []
    worker.submit(batches[0])  # after the end: ignored
    assert tracker.rows == batches


def test_a_sink_that_stalls_keeps_a_bounded_queue_warns_once_and_is_left_behind_at_the_end(monkeypatch):
    import threading

    monkeypatch.setattr(trackers, "QUEUE_BATCHES", 4)
    gate = threading.Event()
    tracker, warnings = _Tracker(gate=gate), []
    worker = trackers.SinkWorker("slow", lambda: tracker, warnings.append, limits=(60.0, 0.05))
    worker.submit([("r", 1, "loss", 1.0, 0.0)])
    _until(tracker.writing.is_set, "the first write never started")
    _until(worker.stalled, "the held write never counted as stalled")
    for step in range(2, 12):  # the caller never waits: 10 more batches, 4 kept
        worker.submit([("r", step, "loss", 1.0, 0.0)])
    assert worker.dropped_batches == 6
    assert not worker.close("finished", timeout=60)  # stalled: not waited for
    gate.set()
    # one warning for the sink's trouble, not one for each of its consequences
    assert [w.split(";")[0] for w in warnings] == ["slow sink: no answer for 0.05 s while writing metrics"]
    assert "dropped if it has not answered when the run ends" in warnings[0]


def test_a_sink_that_answers_slowly_is_waited_for_at_the_end():
    import threading

    gate = threading.Event()
    tracker, warnings = _Tracker(gate=gate), []
    worker = trackers.SinkWorker("busy", lambda: tracker, warnings.append, limits=(60.0, 60.0))
    worker.submit([("r", 1, "loss", 1.0, 0.0)])
    worker.submit([("r", 2, "loss", 0.5, 0.0)])
    _until(tracker.writing.is_set, "the first write never started")
    worker.request_close("finished")
    threading.Timer(0.2, gate.set).start()  # the write returns after the run ended
    assert worker.wait(deadline=float("inf"))
    assert [r[0][1] for r in tracker.rows] == [1, 2] and tracker.closed == ["finished"] and warnings == []


def test_a_sink_that_fails_is_warned_about_once_closed_and_fed_no_more():
    tracker, warnings = _Tracker(fail_on_write=True), []
    worker = trackers.SinkWorker("broken", lambda: tracker, warnings.append)
    worker.submit([("r", 1, "loss", 1.0, 0.0)])
    _until(lambda: worker.failed, "the failure was never noticed")
    worker.submit([("r", 2, "loss", 1.0, 0.0)])
    assert worker.close("finished", timeout=60)
    assert warnings == ["broken sink: OSError while writing metrics: disk full; training continues without it"]
    assert tracker.closed == ["failed"]
    opening, warnings = [], []

    def cannot_open():
        opening.append(1)
        raise PermissionError("no access")

    worker = trackers.SinkWorker("locked", cannot_open, warnings.append)
    assert worker.close("finished", timeout=60) and opening == [1]
    assert warnings == ["locked sink: PermissionError while opening the run: no access; training continues without it"]


def _mlflow_params_respect_the_value_length_and_batch_limits(uri: str) -> None:
    """(In an existing store: a new MLflow SQLite store takes ~20 s to create on a loaded machine.)"""
    from mlflow import MlflowClient

    sink = trackers.MlflowSink(uri, "limits", "run-1")
    params = {f"p.{i:03d}": i for i in range(250)}  # three batches of at most 100
    params["long"] = "x" * 10_000
    params["odd key@x"] = None
    sink.log_params(params)
    sink.log_params({**params, "p.000": 7})  # a second session: one changed value
    got = MlflowClient(tracking_uri=uri).get_run(sink.run_id).data
    assert len(got.params) == 252 and got.params["p.249"] == "249" and got.params["odd key_x"] == "null"
    assert len(got.params["long"]) == trackers.MLFLOW_PARAM_VALUE_MAX and got.params["long"].endswith("[10,000 chars]")
    assert got.params["p.000"] == "0" and got.tags["apr.changed.p.000"] == "7"


def _sink_config(tmp_path: Path, sink: dict, experiment: str = "runtest"):
    from run_helpers import config_doc

    from apr.config.schema import AprConfig

    return AprConfig.model_validate(config_doc(tmp_path, monitoring={"tracking": {"experiment": experiment},
                                                                     "sinks": [sink]}))


def _apr_store(path: Path) -> Path:
    """A SQLite file with apr's store tables (as `apr runs` finds it), under any name."""
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE schema_version (version INTEGER)")
        db.execute("CREATE TABLE runs (id TEXT)")
    db.close()
    return path


def test_sinks_that_would_write_onto_apr_files_or_the_data_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_dataset(tmp_path)
    run, home, data = tmp_path / "run", tmp_path / "home", tmp_path / "data"
    monkeypatch.setenv("APR_HOME", str(home))
    (tmp_path / "to-train").symlink_to(data / "train")
    renamed = _apr_store(tmp_path / "copies" / "my-runs.sqlite")
    refused = [
        ({"type": "mlflow", "uri": f"sqlite:///{run}/.apr/experiments.db"}, "uri", "own experiment store"),
        ({"type": "mlflow", "uri": "sqlite:///run/.apr/experiments.db"}, "uri", "own experiment store"),  # relative
        ({"type": "mlflow", "uri": f"sqlite:///{home}/experiments.db"}, "uri", "an apr experiment store"),
        ({"type": "mlflow", "uri": f"sqlite:///{home}/experiments.db-wal"}, "uri", "an apr experiment store"),
        ({"type": "mlflow", "uri": f"sqlite:///{tmp_path}/elsewhere/experiments.db"}, "uri", "experiment store"),
        ({"type": "mlflow", "uri": f"sqlite:///{renamed}?timeout=5"}, "uri", "apr's runs table"),
        ({"type": "mlflow", "uri": f"sqlite:///{run}/training_state.json"}, "uri", "run's records"),
        ({"type": "mlflow", "uri": f"file://{data}/val/mlruns"}, "uri", "inside data.val"),
        ({"type": "mlflow", "uri": str(data / "train")}, "uri", "at data.train"),
        ({"type": "tensorboard", "dir": str(run / ".apr")}, "dir", "own experiment store"),
        ({"type": "wandb", "dir": "run/.apr/wandb"}, "dir", "own experiment store"),
        ({"type": "tensorboard", "dir": str(run / "checkpoint-step-4.safetensors")}, "dir", "run's records"),
        ({"type": "tensorboard", "dir": str(run / "plan.json")}, "dir", "run's records"),
        ({"type": "wandb", "dir": "data/train"}, "dir", "at data.train"),
        ({"type": "tensorboard", "dir": str(data / "val" / "tb")}, "dir", "inside data.val"),
        ({"type": "tensorboard", "dir": "to-train/tb"}, "dir", "inside data.train"),  # through a symlink
        ({"type": "tensorboard", "dir": str(tmp_path / "data" / "train" / "..")}, "dir", None),  # allowed: data/
    ]
    for sink, key, why in refused:
        problems = trackers.sink_target_problems(_sink_config(tmp_path, sink))
        if why is None:
            assert problems == [], sink
            continue
        ((path, message, expected, got),) = problems
        assert path == f"monitoring.sinks[0].{key}" and f"the {sink['type']} sink's {key}" in message, (sink, message)
        assert why in f"{message} {got}", (sink, message, got)
        assert expected
    # TensorBoard writes <dir>/<experiment>/<run_id>: a dir whose experiment folder is the data is refused
    (problem,) = trackers.sink_target_problems(_sink_config(tmp_path, {"type": "tensorboard", "dir": "data"},
                                                            experiment="train"))
    assert "data.train" in problem[1]
    # an explicit registry (apply's apr_home) and the recorder's stores are protected too
    other = tmp_path / "other-home"
    (problem,) = trackers.sink_target_problems(
        _sink_config(tmp_path, {"type": "mlflow", "uri": f"sqlite:///{other}/experiments.db-shm"}), apr_home=other)
    assert "experiment store" in problem[1]


def test_sinks_of_their_own_and_servers_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_dataset(tmp_path)
    for sink in ({"type": "tensorboard"}, {"type": "wandb"}, {"type": "mlflow"},
                 {"type": "tensorboard", "dir": "run/tb"}, {"type": "wandb", "dir": str(tmp_path / "wandb")},
                 {"type": "mlflow", "uri": "sqlite:///run/mlflow.db"}, {"type": "mlflow", "uri": "mlruns"},
                 {"type": "mlflow", "uri": "http://127.0.0.1:5000"}, {"type": "mlflow", "uri": "sqlite://"},
                 {"type": "mlflow", "uri": "postgresql://u@db/mlflow"}, {"type": "tensorboard", "dir": "."}):
        assert trackers.sink_target_problems(_sink_config(tmp_path, sink)) == [], sink


def test_plan_and_apply_refuse_a_sink_on_the_runs_store_at_its_line_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, monitoring={"sinks": [
        {"type": "tensorboard"},
        {"type": "mlflow", "uri": f"sqlite:///{tmp_path / 'run' / '.apr' / 'experiments.db'}"}]})
    r = CliRunner().invoke(app, ["train", "plan", str(cfg), "--json"])
    assert r.exit_code == 1, r.output
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.sink_target"]
    assert f["path"] == "monitoring.sinks[1].uri" and f["severity"] == "error"
    assert f["line"] == next(i for i, line in enumerate(cfg.read_text().splitlines(), 1) if "uri:" in line)
    r = CliRunner().invoke(app, ["train", "apply", str(cfg)])
    assert r.exit_code == 1 and "monitoring.sinks[1].uri" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run").exists()  # refused before anything was written
    r = CliRunner().invoke(app, ["train", "validate", str(cfg), "--json"])  # knowable from the config alone
    assert r.exit_code == 1 and "config.sink_target" in r.stdout and "monitoring.sinks[1].uri" in r.stdout


def test_the_recorder_refuses_a_sink_on_its_own_registry_when_it_opens_and_the_run_goes_on(tmp_path,
                                                                                          recorder_factory):
    from track_helpers import make_config

    home = tmp_path / "elsewhere"  # apply's apr_home, which the plan could not know
    cfg = make_config(monitoring={"system": {"enabled": False},
                                  "sinks": [{"type": "mlflow", "uri": f"sqlite:///{home}/experiments.db"}]})
    rec = recorder_factory(tmp_path / "run", cfg, apr_home=home)
    rec.start()
    rec.log_step(1, {"loss": 2.0})
    rec.finish("finished")
    (warning,) = [w for w in rec.warnings if w.startswith("mlflow sink:")]
    assert "experiment store" in warning and "continues without it" in warning
    assert json.loads((tmp_path / "run" / "training_state.json").read_text())["status"] == "finished"
    assert not (home / "mlruns").exists() and (home / "experiments.db").exists()  # apr's registry, untouched by MLflow


def test_a_sink_aimed_at_a_device_or_fifo_is_refused_by_validate(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    make_dataset(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "a-file").write_text("x\n")
    for sink, found in (({"type": "mlflow", "uri": "sqlite:////dev/null"}, "a character device"),
                        ({"type": "mlflow", "uri": f"sqlite:///{fifo}"}, "a FIFO"),
                        ({"type": "mlflow", "uri": f"sqlite:///{tmp_path}"}, "a directory"),
                        ({"type": "tensorboard", "dir": str(fifo)}, "a FIFO"),
                        ({"type": "wandb", "dir": "a-file"}, "a regular file")):
        ((key, message, _expected, got),) = trackers.sink_target_problems(_sink_config(tmp_path, sink))
        assert key.startswith("monitoring.sinks[0].") and found in message and found in got, (sink, message)


@pytest.mark.parametrize("target", ["fifo", "device", "read-only folder", "not sqlite"])
def test_an_mlflow_store_that_cannot_be_written_fails_at_once_and_writes_nothing_beside_it(
        tmp_path, monkeypatch, target):
    """MLflow retried such a store for ~100 s after the last step, and SQLite made
    `<device>-journal` beside a device; the sink now fails before MLflow or SQLite see it."""
    import os
    import time

    if target == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    elif target == "device":
        path = Path("/dev/null")
    elif target == "read-only folder":
        (tmp_path / "ro").mkdir()
        path = tmp_path / "ro" / "mlflow.db"
        real_access = os.access
        ro = str(tmp_path / "ro")
        # root may write anywhere: the folder is made read-only for os.access, as it is for a user
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == ro and mode & os.W_OK
                            else real_access(p, mode))
    else:
        path = tmp_path / "runs.db"
        path.write_text("not a database\n")
    before = sorted(os.listdir(path.parent))
    started = time.monotonic()
    with pytest.raises(OSError, match="cannot be written") as err:
        trackers.MlflowSink(f"sqlite:///{path}", "e", "run-1")
    assert time.monotonic() - started < 5
    assert {"fifo": "a FIFO", "device": "a character device", "read-only folder": "is read-only",
            "not sqlite": "not a SQLite database"}[target] in str(err.value)
    assert sorted(os.listdir(path.parent)) == before  # no -journal beside it
