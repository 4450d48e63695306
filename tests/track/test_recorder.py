import hashlib
import json
import math
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from track_helpers import make_config

from apr.errors import AprError
from apr.track import store
from apr.track.state import STATE_FILE, read_state
from apr.track.store import connect_readonly, integrity_check

STATE_FIELDS = {
    "schema_version", "run_id", "experiment", "status", "status_reason", "pid", "host", "started_at", "heartbeat",
    "ended_at", "step", "total_steps", "epoch", "loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s",
    "tokens_seen", "tokens_total", "elapsed_s", "eta_s", "last_checkpoint", "loss_history", "val_loss_history",
    "lr_history", "grad_norm_history", "tokens_per_s_history", "gpu", "alerts", "store_warnings", "output_dir",
    "config_path", "model_params",
}


def _metrics(step):
    return {"loss": 5.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "tokens_seen": 64 * step,
            "epoch": step / 100}


def _local(rec):
    return rec.output_dir / ".apr" / "experiments.db"


def test_full_lifecycle_lands_in_state_and_both_stores(tmp_path, recorder_factory, _private_apr_home):
    run = tmp_path / "run"
    rec = recorder_factory(run, experiment="exp1", config_path="cfg.yaml", model_params=12345)
    rec.flush()
    assert read_state(run)["status"] == "starting"  # the monitor sees the run during setup
    rec.start()
    rec.flush()
    assert read_state(run)["status"] == "running"
    for step in range(1, 21):
        rec.log_step(step, _metrics(step))
    rec.log_eval(20, 2.0)
    ckpt = run / "checkpoint-step-20.safetensors"
    ckpt.write_bytes(b"weights" * 1000)
    rec.checkpoint(20, ckpt, is_best=True)
    rec.finish("finished")

    st = read_state(run)
    assert STATE_FIELDS <= set(st)
    assert (st["run_id"], st["experiment"], st["status"]) == (rec.run_id, "exp1", "finished")
    assert st["step"] == 20 and st["total_steps"] == 100
    assert st["loss"] == pytest.approx(0.25)
    assert st["val_loss"] == 2.0 and st["val_ppl"] == pytest.approx(math.exp(2.0))
    assert st["tokens_seen"] == 1280 and st["tokens_total"] == 6400
    assert st["ended_at"] >= st["started_at"] and st["heartbeat"] == st["ended_at"]
    assert st["last_checkpoint"]["step"] == 20 and st["last_checkpoint"]["path"] == str(ckpt.resolve())
    assert [p[0] for p in st["loss_history"]] == list(range(1, 21))
    assert st["val_loss_history"] == [[20, 2.0]]
    assert st["config_path"] == "cfg.yaml" and st["model_params"] == 12345
    assert st["store_warnings"] == [] and rec.warnings == []

    for db in (_local(rec), _private_apr_home / "experiments.db"):
        conn = connect_readonly(db)
        row = store.get_run(conn, rec.run_id)
        assert (row["status"], row["step"], row["experiment"], row["config_hash"]) == ("finished", 20, "exp1",
                                                                                      "c0ffee")
        assert row["last_loss"] == pytest.approx(0.25) and row["last_val_loss"] == 2.0
        assert len(store.metric_series(conn, rec.run_id, "loss")) == 20
        assert store.metric_series(conn, rec.run_id, "val_ppl") == [(20, pytest.approx(math.exp(2.0)))]
        params = store.run_params(conn, rec.run_id)
        assert params["optimizer.lr"] == 3e-4 and params["training.log_interval"] == 1
        assert params["run.total_steps"] == 100 and params["run.model_params"] == 12345
        (art,) = store.artifacts(conn, rec.run_id)
        assert art["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
        assert (art["size"], art["kind"], art["step"]) == (7000, "checkpoint_best", 20)
        assert [s["status"] for s in store.status_history(conn, rec.run_id)] == ["starting", "running", "finished"]
        conn.close()
        assert integrity_check(db) == "ok"


def test_state_is_rewritten_at_every_log_step(tmp_path, recorder_factory):
    rec = recorder_factory(background=False)
    rec.start()
    for step in (1, 2, 3):
        rec.log_step(step, _metrics(step))
        st = read_state(rec.output_dir)
        assert st["step"] == step and st["loss"] == pytest.approx(5.0 / step)
    assert st["heartbeat"] >= st["started_at"]
    assert st["eta_s"] is not None and st["eta_s"] > 0
    assert st["elapsed_s"] > 0


def test_background_writes_arrive_after_flush(tmp_path, recorder_factory):
    rec = recorder_factory()
    rec.start()
    for step in range(1, 201):
        rec.log_step(step, _metrics(step))
    rec.flush()
    assert read_state(rec.output_dir)["step"] == 200
    conn = connect_readonly(_local(rec))
    assert len(store.metric_series(conn, rec.run_id, "loss")) == 200
    conn.close()


def test_non_finite_metrics_do_not_break_the_records(tmp_path, recorder_factory):
    rec = recorder_factory(background=False)
    rec.start()
    rec.log_step(1, _metrics(1))
    bad = {**_metrics(2), "loss": math.nan, "grad_norm": math.inf}
    rec.log_step(2, bad)
    rec.finish("failed", "non-finite loss at step 2")
    st = read_state(rec.output_dir)
    assert st["loss"] is None and st["grad_norm"] is None
    assert (st["status"], st["status_reason"]) == ("failed", "non-finite loss at step 2")
    assert st["eta_s"] is None
    conn = connect_readonly(_local(rec))
    assert store.metric_series(conn, rec.run_id, "loss") == [(1, 5.0), (2, None)]
    assert store.get_run(conn, rec.run_id)["status_reason"] == "non-finite loss at step 2"
    conn.close()


def test_alerts_are_returned_and_recorded(tmp_path, recorder_factory):
    cfg = make_config(monitoring={"system": {"enabled": False}, "alerts": [
        {"condition": "loss > 3", "action": "warn", "message": "loss high"},
        {"condition": "grad_norm > 100", "action": "stop", "message": "gradients exploded"},
    ]})
    rec = recorder_factory(cfg=cfg, background=False)
    rec.start()
    m = {**_metrics(1), "step": 1}  # loss 5.0
    rec.log_step(1, m)
    (warn,) = rec.check_alerts(m)
    assert (warn.action, warn.step, warn.condition) == ("warn", 1, "loss > 3")
    assert rec.check_alerts(m) == []  # still true: a warn does not repeat
    stop_m = {**_metrics(2), "step": 2, "grad_norm": 500.0}
    (stop,) = rec.check_alerts(stop_m)
    assert stop.action == "stop" and stop.message.startswith("gradients exploded")
    rec.finish("stopped", stop.message)
    st = read_state(rec.output_dir)
    assert [(a["step"], a["action"]) for a in st["alerts"]] == [(1, "warn"), (2, "stop")]
    assert set(st["alerts"][0]) == {"time", "step", "condition", "severity", "action", "message"}
    assert [a["severity"] for a in st["alerts"]] == ["warning", "error"]  # what warn and stop mean
    conn = connect_readonly(_local(rec))
    assert [a["action"] for a in store.alerts(conn, rec.run_id)] == ["warn", "stop"]
    conn.close()


def test_bad_inputs_fail_before_anything_is_written(tmp_path, recorder_factory):
    with pytest.raises(AprError):
        recorder_factory(run_id="../../etc")
    with pytest.raises(AprError):
        recorder_factory(experiment="a/b")
    with pytest.raises(AprError):
        recorder_factory(cfg=make_config(monitoring={"alerts": [{"condition": "perplexity > 3"}]}))
    assert not (tmp_path / "run").exists()
    rec = recorder_factory(background=False)
    with pytest.raises(ValueError):
        rec.finish("done")


def test_default_experiment_comes_from_config_then_folder(tmp_path, recorder_factory):
    assert recorder_factory(tmp_path / "my run").experiment == "my-run"
    cfg = make_config(monitoring={"system": {"enabled": False}, "tracking": {"experiment": "sweep-1"}})
    assert recorder_factory(tmp_path / "b", cfg=cfg).experiment == "sweep-1"


def test_tracking_disabled_writes_the_state_file_but_no_store(tmp_path, recorder_factory, _private_apr_home):
    rec = recorder_factory(enabled=False, background=False)
    rec.start()
    rec.log_step(1, _metrics(1))
    rec.finish("finished")
    assert read_state(rec.output_dir)["status"] == "finished"
    assert not _local(rec).exists() and not (_private_apr_home / "experiments.db").exists()
    cfg = make_config(monitoring={"system": {"enabled": False}, "tracking": {"enabled": False}})
    rec2 = recorder_factory(tmp_path / "r2", cfg=cfg, background=False)
    rec2.start()
    rec2.finish("finished")
    assert not _local(rec2).exists()


def test_resume_keeps_history_up_to_the_checkpoint_and_drops_replayed_metrics(tmp_path, recorder_factory):
    first = recorder_factory(background=False)
    first.start()
    for step in range(1, 11):
        first.log_step(step, _metrics(step))
    first.finish("failed", "killed")
    started = read_state(first.output_dir)["started_at"]

    again = recorder_factory(run_id=first.run_id, background=False)
    again.start(resume_step=6)
    for step in range(7, 9):
        again.log_step(step, {**_metrics(step), "loss": 100.0 + step})
    again.finish("finished")
    st = read_state(again.output_dir)
    assert st["started_at"] == started
    assert st["loss_history"] == [[s, pytest.approx(5.0 / s)] for s in range(1, 7)] + [[7, 107.0], [8, 108.0]]
    conn = connect_readonly(_local(again))
    assert store.metric_series(conn, first.run_id, "loss")[-3:] == [(6, pytest.approx(5 / 6)), (7, 107.0),
                                                                      (8, 108.0)]
    assert [s["status"] for s in store.status_history(conn, first.run_id)] == [
        "starting", "running", "failed", "starting", "running", "finished"]
    conn.close()


def test_a_resumed_run_shows_its_last_values_up_to_the_checkpoint_until_it_logs(tmp_path, recorder_factory):
    first = recorder_factory(background=False)
    first.start()
    for step in range(1, 11):
        first.log_step(step, _metrics(step))
        if step % 4 == 0:
            first.log_eval(step, 4.0 - step / 10)
    first.finish("stopped", "SIGINT")

    again = recorder_factory(run_id=first.run_id, background=False)
    again.start(resume_step=8)
    again.flush()
    st = read_state(again.output_dir)  # as a monitor sees it before the resumed process logs a step
    assert st["step"] == 8 and st["tokens_seen"] == 8 * 64
    assert st["loss"] == pytest.approx(5.0 / 8) and st["val_loss"] == pytest.approx(3.2)
    assert st["val_ppl"] == pytest.approx(math.exp(3.2)) and st["lr"] == pytest.approx(1e-3)
    again.finish("stopped", "SIGINT again")
    assert read_state(again.output_dir)["loss"] == pytest.approx(5.0 / 8)


def test_read_only_registry_and_unwritable_local_store_warn_once_and_training_goes_on(
    tmp_path, recorder_factory, read_only, _private_apr_home, capsys
):
    # An earlier run created the registry; now it is read-only, and so is this run's .apr folder.
    earlier = recorder_factory(tmp_path / "earlier", background=False)
    earlier.start()
    earlier.finish("finished")
    registry = _private_apr_home / "experiments.db"
    read_only(registry, _private_apr_home)
    run = tmp_path / "run"
    (run / ".apr").mkdir(parents=True)
    read_only(run / ".apr")
    capsys.readouterr()

    rec = recorder_factory(run)
    rec.start()
    for step in range(1, 51):
        rec.log_step(step, _metrics(step))
        rec.check_alerts(_metrics(step))
    rec.log_eval(50, 1.0)
    rec.finish("finished")

    warnings = rec.warnings
    assert len(warnings) == 2
    assert any(w.startswith("local experiment store") for w in warnings)
    assert any(w.startswith("global experiment store") for w in warnings)
    err = capsys.readouterr().err
    assert err.count("apr: warning:") == 2
    st = read_state(run)
    assert st["status"] == "finished" and st["step"] == 50
    assert st["store_warnings"] == warnings
    assert not (run / ".apr" / "experiments.db").exists()
    assert integrity_check(registry) == "ok"
    conn = connect_readonly(registry)
    assert store.get_run(conn, rec.run_id) is None  # nothing was written there
    conn.close()


def test_a_locked_registry_is_retried_and_receives_everything_at_the_end(
    tmp_path, recorder_factory, _private_apr_home
):
    registry = _private_apr_home / "experiments.db"
    warm = recorder_factory(tmp_path / "warm", background=False)
    warm.start()
    warm.finish("finished")
    blocker = sqlite3.connect(registry, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    rec = recorder_factory(busy_timeout_s=0.05, background=False, flush_interval_s=0.0)
    rec.start()
    for step in range(1, 31):
        rec.log_step(step, _metrics(step))
    assert len(rec.warnings) == 1 and "global experiment store" in rec.warnings[0]
    blocker.execute("ROLLBACK")
    blocker.close()
    rec.finish("finished")  # the final write ignores the back-off and succeeds
    conn = connect_readonly(registry)
    assert store.get_run(conn, rec.run_id)["status"] == "finished"
    assert len(store.metric_series(conn, rec.run_id, "loss")) == 30
    conn.close()
    assert integrity_check(registry) == "ok"


def test_an_unwritable_run_folder_is_a_warning_not_a_crash(tmp_path, recorder_factory, read_only):
    run = tmp_path / "run"
    run.mkdir()
    read_only(run)
    rec = recorder_factory(run, background=False)
    rec.start()
    rec.log_step(1, _metrics(1))
    rec.finish("finished")
    assert any(STATE_FILE in w for w in rec.warnings)
    assert sum(STATE_FILE in w for w in rec.warnings) == 1


def test_a_process_that_exits_without_finish_is_recorded_as_failed(tmp_path):
    run = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from track_helpers import make_config
        from apr.track.recorder import RunRecorder
        rec = RunRecorder(Path({str(run)!r}), make_config(), config_hash="h", total_steps=10, tokens_per_step=1)
        rec.start()
        rec.log_step(1, {{"loss": 1.0}})
        raise SystemExit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    st = json.loads((run / STATE_FILE).read_text())
    assert st["status"] == "failed" and "exited" in st["status_reason"]
    conn = connect_readonly(run / ".apr" / "experiments.db")
    assert store.get_run(conn, st["run_id"])["status"] == "failed"
    conn.close()


def test_a_registry_that_cannot_exist_and_a_full_disk_each_warn_once(tmp_path, recorder_factory, monkeypatch):
    """The other best-effort cases of issue 8: a registry whose folder cannot be made (APR_HOME below
    a regular file) and a local store on a full disk (SQLite's page limit: a real SQLITE_FULL)."""
    from apr.track.store import StoreWriter

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    original_open = StoreWriter.open

    def open_on_a_full_disk(self):
        original_open(self)
        if self.path.parent.name == ".apr":
            pages = self.db.conn.execute("PRAGMA page_count").fetchone()[0]
            self.db.conn.execute(f"PRAGMA max_page_count = {int(pages)}")

    monkeypatch.setattr(StoreWriter, "open", open_on_a_full_disk)
    rec = recorder_factory(apr_home=not_a_folder / "apr", flush_interval_s=0.0, background=False)
    rec.start()
    for step in range(1, 101):
        rec.log_step(step, _metrics(step))  # every step is due for a store write
    rec.finish("finished")
    warnings = rec.warnings
    assert len(warnings) == 2
    (local_w,) = [w for w in warnings if w.startswith("local experiment store")]
    (global_w,) = [w for w in warnings if w.startswith("global experiment store")]
    assert "database or disk is full" in local_w
    assert str(not_a_folder) in global_w
    st = read_state(rec.output_dir)
    assert (st["status"], st["step"], st["store_warnings"]) == ("finished", 100, warnings)
    assert integrity_check(_local(rec)) == "ok"


def test_an_apr_checkpoint_is_recorded_as_its_weights_and_its_metadata(tmp_path, recorder_factory):
    from apr.track.runs import show_run

    run = tmp_path / "run"
    run.mkdir()

    def apr_checkpoint(step, weights_bytes, sha=None, size=None):
        weights = run / f"checkpoint-step-{step}.safetensors"
        weights.write_bytes(weights_bytes)
        meta = run / f"checkpoint-step-{step}.json"
        meta.write_text(json.dumps({"format": "apr-checkpoint", "weights_file": weights.name,
                                    "weights_sha256": sha or hashlib.sha256(weights_bytes).hexdigest(),
                                    "weights_size": len(weights_bytes) if size is None else size}))
        return weights, meta

    w4, m4 = apr_checkpoint(4, b"w" * 4096, sha="f" * 64)  # size matches: the writer's hash is trusted
    w8, m8 = apr_checkpoint(8, b"x" * 10, sha="0" * 64, size=99)  # size differs: hashed again
    rec = recorder_factory(run, background=False)
    rec.start()
    rec.checkpoint(4, m4, is_best=True)
    rec.checkpoint(8, m8)
    rec.finish("finished")
    assert read_state(run)["last_checkpoint"]["path"] == str(m8)
    conn = connect_readonly(_local(rec))
    rows = {Path(a["path"]).name: a for a in store.artifacts(conn, rec.run_id)}
    conn.close()
    assert {n: (a["kind"], a["step"]) for n, a in rows.items()} == {
        w4.name: ("checkpoint_best", 4), m4.name: ("checkpoint_meta", 4),
        w8.name: ("checkpoint", 8), m8.name: ("checkpoint_meta", 8)}
    assert (rows[w4.name]["size"], rows[w4.name]["sha256"]) == (4096, "f" * 64)
    assert (rows[w8.name]["size"], rows[w8.name]["sha256"]) == (10, hashlib.sha256(b"x" * 10).hexdigest())
    assert rows[m4.name]["sha256"] == hashlib.sha256(m4.read_bytes()).hexdigest()
    detail = show_run(rec.run_id, root=tmp_path)
    assert [Path(c["path"]).name for c in detail["checkpoints"]] == [w4.name, w8.name]
    assert len(detail["artifacts"]) == 4


def test_warnings_are_printed_by_the_training_thread_as_whole_lines(tmp_path, recorder_factory, read_only,
                                                                      monkeypatch):
    """The writer thread finds the failure; the trainer's thread prints it at its next call, in one
    write, so it never lands in the middle of the trainer's own console lines."""
    import threading

    writes: list[tuple[str, str]] = []

    class Stderr:
        def write(self, text):
            writes.append((threading.current_thread().name, text))

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    (tmp_path / "run" / ".apr").mkdir(parents=True)
    read_only(tmp_path / "run" / ".apr")
    rec = recorder_factory(tmp_path / "run")
    rec.start()
    for step in range(1, 4):
        rec.log_step(step, _metrics(step))
    rec.finish("finished")
    warned = [(t, w) for t, w in writes if "apr: warning:" in w]
    assert len(warned) == 1 and any(w.startswith("local experiment store") for w in rec.warnings)
    thread, text = warned[0]
    assert thread == threading.main_thread().name
    assert text.startswith("apr: warning: local experiment store") and text.endswith("\n") and text.count("\n") == 1


def test_a_checkpoint_file_nested_too_deep_is_recorded_as_one_plain_artifact(tmp_path, recorder_factory):
    """The checkpoint JSON is read through apr.readers: 100,000 levels of nesting (RecursionError
    for json.loads) do not reach the recorder, which records the file as it would any other."""
    run = tmp_path / "run"
    run.mkdir()
    deep = run / "checkpoint-step-3.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    rec = recorder_factory(run, background=False)
    rec.start()
    rec.checkpoint(3, deep)
    rec.finish("finished")
    assert read_state(run)["status"] == "finished" and rec.warnings == []
    conn = connect_readonly(_local(rec))
    rows = store.artifacts(conn, rec.run_id)
    conn.close()
    assert [(Path(a["path"]).name, a["kind"], a["size"], a["sha256"]) for a in rows] == [
        (deep.name, "checkpoint", deep.stat().st_size, hashlib.sha256(deep.read_bytes()).hexdigest())]


def test_system_metrics_choose_the_recorded_gpu_fields():
    from apr.track.recorder import _only_metrics

    snap = {"name": "H100", "utilization": 97, "memory_used": 1, "memory_total": 2, "temperature": 60,
            "power_w": 300.0}
    assert _only_metrics(snap, ["temperature"]) == {"name": "H100", "utilization": None, "memory_used": None,
                                                     "memory_total": None, "temperature": 60, "power_w": None}
    assert _only_metrics(snap, ["gpu_utilization", "memory", "temperature", "power"]) == snap
    assert _only_metrics(None, ["memory"]) is None
