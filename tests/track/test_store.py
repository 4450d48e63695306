import sqlite3
import time

import pytest

from apr.track import store
from apr.track.store import (
    SCHEMA_VERSION,
    Batch,
    StoreError,
    StoreWriter,
    connect_readonly,
    flatten_params,
    integrity_check,
)


def _run(run_id="r1", **kw):
    row = {"id": run_id, "experiment": "exp", "status": "running", "started": time.time(), "step": 0}
    row.update(kw)
    return row


def _write(path, run, **batch):
    w = StoreWriter(path)
    try:
        w.write(Batch(run=run, **batch))
    finally:
        w.close()


def test_new_store_is_wal_versioned_and_has_every_table(tmp_path):
    db = tmp_path / "sub" / "experiments.db"
    _write(db, _run(), register={"params": {}})
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"experiments", "runs", "params", "metrics", "artifacts", "status_history", "alerts"} <= tables
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"runs_started", "metrics_run_key_step"} <= indexes
    conn.close()
    # Opening again migrates nothing: one version row per migration.
    _write(db, _run())
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    assert integrity_check(db) == "ok"


def test_store_from_a_newer_apr_is_refused_not_modified(tmp_path):
    db = tmp_path / "experiments.db"
    _write(db, _run(), register={"params": {}})
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO schema_version VALUES (?, ?)", (SCHEMA_VERSION + 1, 0.0))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as e:
        _write(db, _run())
    assert e.value.findings[0].code == "track.store_version"
    with pytest.raises(StoreError):
        connect_readonly(db)


def test_reader_refuses_missing_and_foreign_databases(tmp_path):
    with pytest.raises(StoreError) as e:
        connect_readonly(tmp_path / "nope.db")
    assert e.value.findings[0].code == "track.store_missing"
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    with pytest.raises(StoreError) as e:
        connect_readonly(other)
    assert e.value.findings[0].code == "track.store_invalid"
    assert not (tmp_path / "nope.db").exists()  # reading never creates a store


def test_params_keep_their_types():
    cfg = {"optimizer": {"lr": 3e-4, "name": "adamw"}, "training": {"max_steps": 10, "grad_clip": None},
           "data": {"shuffle": True, "numbers": [1, 2]}, "tags": {}, "flag": "123"}
    flat = flatten_params(cfg)
    assert flat["optimizer.lr"] == (3e-4, "float")
    assert flat["training.max_steps"] == (10, "int")
    assert flat["training.grad_clip"] == (None, "null")
    assert flat["data.shuffle"] == (1, "bool")
    assert flat["data.numbers"] == ("[1, 2]", "json")
    assert flat["tags"] == ('{}', "json")
    assert flat["flag"] == ("123", "str")


def test_params_round_trip_through_the_store(tmp_path):
    db = tmp_path / "experiments.db"
    cfg = {"optimizer": {"lr": 3e-4}, "steps": 10, "on": False, "name": "007", "list": [1, "a"], "none": None}
    _write(db, _run(), register={"params": flatten_params(cfg)})
    conn = connect_readonly(db)
    assert store.run_params(conn, "r1") == {
        "optimizer.lr": 3e-4, "steps": 10, "on": False, "name": "007", "list": [1, "a"], "none": None
    }
    # Native types in SQL too, so a query can compare numbers.
    row = conn.execute("SELECT typeof(value) FROM params WHERE key = 'optimizer.lr'").fetchone()
    assert row[0] == "real"
    conn.close()


def test_metrics_artifacts_status_and_alerts_are_recorded(tmp_path):
    db = tmp_path / "experiments.db"
    t = time.time()
    _write(
        db,
        _run(step=2, last_loss=1.5),
        register={"params": {}},
        metrics=[("r1", 1, "loss", 2.0, t), ("r1", 2, "loss", 1.5, t + 1), ("r1", 2, "lr", 1e-3, t + 1)],
        status=[("r1", "running", None, t)],
        artifacts=[{"run_id": "r1", "path": "/c.safetensors", "kind": "checkpoint", "size": 5, "sha256": "ab",
                    "step": 2, "time": t}],
        alerts=[("r1", 2, t, "loss > 1", "warn", "high", "warning")],
    )
    conn = connect_readonly(db)
    assert store.metric_series(conn, "r1", "loss") == [(1, 2.0), (2, 1.5)]
    assert store.final_metrics(conn, "r1")["loss"]["value"] == 1.5
    assert store.metric_keys(conn, "r1") == ["loss", "lr"]
    assert store.artifacts(conn, "r1")[0]["sha256"] == "ab"
    assert [s["status"] for s in store.status_history(conn, "r1")] == ["running"]
    assert store.alerts(conn, "r1")[0]["condition"] == "loss > 1"
    assert store.get_run(conn, "r1")["last_loss"] == 1.5
    conn.close()


def test_resume_registration_drops_metrics_after_the_checkpoint(tmp_path):
    db = tmp_path / "experiments.db"
    t = time.time()
    _write(db, _run(), register={"params": {}}, metrics=[("r1", s, "loss", 1.0, t) for s in range(1, 11)])
    _write(db, _run(), register={"params": {}, "resume_step": 6})
    conn = connect_readonly(db)
    assert [s for s, _ in store.metric_series(conn, "r1", "loss")] == [1, 2, 3, 4, 5, 6]
    conn.close()


def test_query_filters_are_parameterised(tmp_path):
    db = tmp_path / "experiments.db"
    for i, (exp, status) in enumerate([("a", "finished"), ("b", "failed"), ("a", "running")]):
        _write(db, _run(f"r{i}", experiment=exp, status=status, started=100.0 + i), register={"params": {}})
    conn = connect_readonly(db)
    assert [r["id"] for r in store.query_runs(conn)] == ["r2", "r1", "r0"]
    assert [r["id"] for r in store.query_runs(conn, experiment="a")] == ["r2", "r0"]
    assert [r["id"] for r in store.query_runs(conn, statuses=("failed",))] == ["r1"]
    assert [r["id"] for r in store.query_runs(conn, limit=1)] == ["r2"]
    assert store.query_runs(conn, experiment="a' OR '1'='1") == []
    # LIKE wildcards in a prefix are literal.
    assert sorted(store.find_run_ids(conn, "r")) == ["r0", "r1", "r2"]
    assert store.find_run_ids(conn, "%") == []
    assert store.find_run_ids(conn, "_0") == []
    conn.close()


def test_reader_works_on_a_store_in_an_unwritable_folder(tmp_path, read_only):
    folder = tmp_path / "ro"
    db = folder / "experiments.db"
    _write(db, _run(), register={"params": {}})
    read_only(db, folder)
    conn = connect_readonly(db)
    assert store.get_run(conn, "r1")["status"] == "running"
    conn.close()
    assert integrity_check(db) == "ok"


def test_version_3_alert_rows_gain_a_severity_read_from_their_action(tmp_path):
    db = tmp_path / "experiments.db"
    conn = sqlite3.connect(db)  # a store as apr wrote it before severities: migrations 1 to 3
    import sqlite_utils

    old = sqlite_utils.Database(conn)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL, applied REAL NOT NULL)")
    for version in (1, 2, 3):
        store.MIGRATIONS[version](old)
        conn.execute("INSERT INTO schema_version VALUES (?, ?)", (version, 0.0))
    conn.execute("INSERT INTO experiments VALUES ('exp', 0.0)")
    conn.execute("INSERT INTO runs (id, experiment, status) VALUES ('r1', 'exp', 'running')")
    conn.execute("INSERT INTO alerts (run_id, step, time, condition, action, message) "
                 "VALUES ('r1', 5, 1.0, 'loss > 9', 'stop', 'boom')")
    conn.commit()
    conn.close()
    _write(db, _run(), alerts=[("r1", 6, 2.0, "loss > 1", "warn", "hm", "info")])
    reader = connect_readonly(db)
    rows = store.alerts(reader, "r1")
    reader.close()
    assert [(r["step"], r["action"], r["severity"]) for r in rows] == [(5, "stop", "error"), (6, "warn", "info")]
