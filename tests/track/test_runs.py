"""apr.track.runs (the library) and `apr runs ls/show` (through typer's CliRunner)."""

import json
import os
import time

import pytest
from typer.testing import CliRunner

from apr.cli.cmd_runs import fast_path
from apr.cli.main import app
from apr.errors import AprError
from apr.track.runs import find_local_stores, list_runs, show_run
from apr.track.store import Batch, StoreWriter

RUN_KEYS = {
    "run_id", "experiment", "status", "recorded_status", "status_reason", "step", "total_steps", "last_loss",
    "last_val_loss", "tokens_seen", "started_at", "ended_at", "heartbeat", "duration_s", "host", "pid",
    "pid_alive", "output_dir", "config_path", "config_hash", "model_params", "store", "parent",
}

runner = CliRunner()


def _record(rec_factory, folder, steps=5, status="finished", experiment="exp", **kw):
    rec = rec_factory(folder, experiment=experiment, background=False, **kw)
    rec.start()
    for s in range(1, steps + 1):
        rec.log_step(s, {"loss": 4.0 / s, "lr": 1e-3})
    rec.finish(status)
    return rec


def _dead_run(db, run_id="20260101-000000-dead00", heartbeat_age=3600.0):
    """A run recorded as running whose process vanished an hour ago."""
    now = time.time()
    w = StoreWriter(db)
    w.write(Batch(run={"id": run_id, "experiment": "exp", "status": "running", "started": now - 7200,
                       "heartbeat": now - heartbeat_age, "step": 3, "total_steps": 10}, register={"params": {}}))
    w.close()
    return run_id


@pytest.fixture
def runs_tree(tmp_path, recorder_factory, monkeypatch):
    a = _record(recorder_factory, tmp_path / "runs" / "a", experiment="alpha", run_id="20261122-000000-aaaa01")
    b = _record(recorder_factory, tmp_path / "runs" / "b", status="failed", experiment="beta",
                run_id="20261122-000000-aaaa02")
    c = _record(recorder_factory, tmp_path / "deep" / "x" / "c", experiment="alpha")
    monkeypatch.chdir(tmp_path)
    return a, b, c


def test_local_stores_are_found_a_few_levels_down_but_not_in_hidden_folders(tmp_path, runs_tree):
    (tmp_path / ".hidden" / ".apr").mkdir(parents=True)
    (tmp_path / ".hidden" / ".apr" / "experiments.db").write_bytes(b"")
    too_deep = tmp_path / "a" / "b" / "c" / "d" / ".apr"
    too_deep.mkdir(parents=True)
    (too_deep / "experiments.db").write_bytes(b"")
    found = find_local_stores(tmp_path)
    assert sorted(p.parent.parent.name for p in found) == ["a", "b", "c"]


def test_list_runs_newest_first_with_filters(runs_tree):
    a, b, c = runs_tree
    assert [r["run_id"] for r in list_runs().runs] == [c.run_id, b.run_id, a.run_id]
    assert [r["run_id"] for r in list_runs(status="failed").runs] == [b.run_id]
    assert [r["run_id"] for r in list_runs(experiment="alpha").runs] == [c.run_id, a.run_id]
    assert [r["run_id"] for r in list_runs(limit=1).runs] == [c.run_id]
    assert list_runs(global_=True).runs[0]["run_id"] == c.run_id  # the registry holds them too
    run = list_runs().runs[0]
    assert set(run) == RUN_KEYS
    assert (run["step"], run["total_steps"], run["last_loss"]) == (5, 100, 0.8)
    assert run["duration_s"] >= 0


def test_stale_runs_are_detected_and_filterable(tmp_path, runs_tree):
    dead = _dead_run(tmp_path / "runs" / "a" / ".apr" / "experiments.db")
    run = next(r for r in list_runs().runs if r["run_id"] == dead)
    assert (run["status"], run["recorded_status"]) == ("stale", "running")
    assert [r["run_id"] for r in list_runs(status="stale").runs] == [dead]
    assert list_runs(status="running").runs == []
    assert list_runs(status="running", stale_after_s=10 * 3600).runs[0]["run_id"] == dead


TRAINER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {helpers!r})
from track_helpers import make_config
from apr.track.recorder import RunRecorder
rec = RunRecorder(Path({out!r}), make_config(), config_hash="c0ffee", total_steps=100, tokens_per_step=64,
                  run_id={run_id!r}, background=False)
rec.start()
rec.log_step(1, {{"loss": 2.0}})
print("ready", flush=True)
time.sleep(300)
"""


def _wait_for_status(run_id, status, seconds=30.0):
    deadline = time.monotonic() + seconds
    while True:
        run = next(r for r in list_runs().runs if r["run_id"] == run_id)
        if run["status"] == status or time.monotonic() > deadline:
            return run
        time.sleep(0.05)


def test_a_trainer_killed_with_sigkill_is_dead_at_once_not_running_until_stale(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    run_id = "20261125-000000-k1ll09"
    helpers = str(Path(__file__).resolve().parent)
    code = TRAINER.format(helpers=helpers, out=str(tmp_path / "run"), run_id=run_id)
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        monkeypatch.chdir(tmp_path)
        run = _wait_for_status(run_id, "running")
        assert (run["status"], run["pid"], run["pid_alive"]) == ("running", trainer.pid, True)
        os.kill(trainer.pid, signal.SIGKILL)
        run = _wait_for_status(run_id, "dead")  # a zombie until reaped: already dead
        assert (run["status"], run["recorded_status"], run["pid_alive"]) == ("dead", "running", False)
    finally:
        trainer.kill()
        trainer.wait()
    run = _wait_for_status(run_id, "dead")
    assert run["status"] == "dead" and time.time() - run["heartbeat"] < 60  # long before the stale threshold
    assert run["duration_s"] == pytest.approx(run["heartbeat"] - run["started_at"])
    assert [r["run_id"] for r in list_runs(status="dead").runs] == [run_id]
    assert list_runs(status="running").runs == [] and list_runs(status="stale").runs == []
    out = runner.invoke(app, ["runs", "ls"]).output
    assert run_id in out and "dead" in out.split(run_id, 1)[1].splitlines()[0]
    assert json.loads(runner.invoke(app, ["runs", "show", run_id, "--json"]).output)["run"]["status"] == "dead"
    shown = runner.invoke(app, ["runs", "show", run_id]).output
    assert f"status     dead (recorded as running; its trainer, pid {run['pid']} on this host, is gone" in shown


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc to see whose a PID is")
def test_a_reused_pid_is_not_the_trainer(tmp_path):
    import socket
    import subprocess
    import sys

    from apr.track.liveness import trainer_alive

    here = socket.gethostname()
    now = time.time()
    other = subprocess.Popen(["sleep", "60"])  # not Python, not apr
    try:
        for _ in range(1000):  # until the forked child has exec'd sleep
            if open(f"/proc/{other.pid}/cmdline", "rb").read().startswith(b"sleep"):
                break
            time.sleep(0.01)
        assert trainer_alive(here, other.pid, now + 30) is False  # alive, but not a trainer
        assert trainer_alive(here, other.pid, now - 3600) is False  # started after the run's last heartbeat
        assert trainer_alive(here, os.getpid(), now) is True
    finally:
        other.kill()
        other.wait()
    python = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert trainer_alive(here, python.pid, time.time() + 5) is True  # started before its heartbeat
        assert trainer_alive(here, python.pid, now - 3600) is False  # the PID of a run long gone, reused
        assert trainer_alive("another-host", python.pid, now) is None  # nothing can be known from here
    finally:
        python.kill()
        python.wait()
    assert trainer_alive(here, python.pid, now) is False
    assert trainer_alive(here, None, now) is None and trainer_alive(None, 123, now) is None
    assert trainer_alive(here, True, now) is None and trainer_alive(here, -1, now) is None


def test_a_run_recorded_on_another_host_waits_for_the_stale_threshold(tmp_path, monkeypatch):
    now = time.time()
    db = tmp_path / "r" / ".apr" / "experiments.db"
    w = StoreWriter(db)
    for run_id, host in (("20261125-000000-0the01", "another-host"), ("20261125-000000-0the02", None)):
        w.write(Batch(run={"id": run_id, "experiment": "exp", "status": "running", "started": now - 60,
                           "heartbeat": now - 5, "step": 3, "total_steps": 10, "host": host, "pid": 999_999},
                      register={"params": {}}))
    w.close()
    monkeypatch.chdir(tmp_path)
    assert {(r["status"], r["pid_alive"]) for r in list_runs().runs} == {("running", None)}
    assert {r["status"] for r in list_runs(now=now + 3600).runs} == {"stale"}


def test_bad_filters_are_errors(runs_tree):
    for kwargs in ({"status": "zombie"}, {"experiment": "../x"}, {"limit": -1}):
        with pytest.raises(AprError):
            list_runs(**kwargs)


def test_show_run_by_prefix_has_params_metrics_and_history(runs_tree):
    _, _, c = runs_tree
    detail = show_run(c.run_id[:-2])
    assert detail["run"]["run_id"] == c.run_id
    assert detail["params"]["optimizer.lr"] == 3e-4
    assert detail["final_metrics"]["loss"] == {"step": 5, "value": 0.8, "time": pytest.approx(time.time(), abs=120)}
    assert [s["status"] for s in detail["status_history"]] == ["starting", "running", "finished"]
    assert set(detail) == {"run", "params", "final_metrics", "best_val_loss", "artifacts", "checkpoints",
                           "status_history", "alerts", "alert_counts", "events", "tags", "parent", "forecast", "forks"}
    assert detail["parent"] is None  # not a fork (apr train fork)
    assert detail["forecast"] is None  # fewer validations than a forecast needs


def test_show_run_errors(runs_tree):
    a, b, _ = runs_tree
    with pytest.raises(AprError) as e:
        show_run("20991231-000000-ffffff")
    assert e.value.findings[0].code == "runs.not_found"
    with pytest.raises(AprError) as e:
        show_run("20261122-000000-aaaa0")
    assert e.value.findings[0].code == "runs.ambiguous"
    assert show_run("20261122-000000-aaaa02")["run"]["run_id"] == b.run_id
    with pytest.raises(AprError) as e:
        show_run("../../etc/passwd")
    assert e.value.findings[0].code == "track.invalid_run_id"


# ------------------------------------------------------------------------------------------ CLI


def test_cli_ls_table_and_json(runs_tree):
    a, b, c = runs_tree
    result = runner.invoke(app, ["runs", "ls"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["RUN", "ID", "EXPERIMENT"]
    assert [ln.split()[0] for ln in lines[1:]] == [c.run_id, b.run_id, a.run_id]
    assert "failed" in lines[2] and "5/100" in lines[2]

    result = runner.invoke(app, ["runs", "ls", "--json", "--experiment", "alpha", "--limit", "5"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert [r["run_id"] for r in doc] == [c.run_id, a.run_id]
    assert all(set(r) == RUN_KEYS for r in doc)


def _fork(rec_factory, folder, parent, at, run_id):
    """A run recorded as `apr train fork` records one: its fork event names the parent and step."""
    rec = rec_factory(folder, experiment="alpha", background=False, run_id=run_id)
    rec.start(resume_step=at)
    rec.log_event("fork", at, f"forked from run {parent} at step {at}",
                  {"parent": {"run_id": parent, "step": at}, "parent_dir": "x", "overrides": {}})
    for s in range(at + 1, at + 3):
        rec.log_step(s, {"loss": 1.0 / s})
    rec.finish("finished")
    return rec


def test_ls_shows_a_forks_parent_run_and_step(runs_tree, recorder_factory, tmp_path):
    a, b, c = runs_tree
    fork = _fork(recorder_factory, tmp_path / "runs" / "a-fork-3", a.run_id, 3, "20261122-000000-aaaa09")
    by_id = {r["run_id"]: r for r in list_runs().runs}
    assert by_id[fork.run_id]["parent"] == {"run_id": a.run_id, "step": 3}
    assert by_id[a.run_id]["parent"] is None and by_id[b.run_id]["parent"] is None
    assert list_runs(global_=True).runs[0]["parent"] == {"run_id": a.run_id, "step": 3}  # the registry too
    result = runner.invoke(app, ["runs", "ls"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[-1] == "PARENT"
    assert next(ln for ln in lines if ln.startswith(fork.run_id)).split()[-1] == f"{a.run_id}@3"
    assert next(ln for ln in lines if ln.startswith(b.run_id)).split()[-1] == "-"
    doc = json.loads(runner.invoke(app, ["runs", "ls", "--json"]).stdout)
    assert {r["run_id"]: r["parent"] for r in doc}[fork.run_id] == {"run_id": a.run_id, "step": 3}
    shown = runner.invoke(app, ["runs", "show", fork.run_id])
    assert f"parent     {a.run_id}@3 (apr train fork)" in shown.stdout
    assert json.loads(runner.invoke(app, ["runs", "show", fork.run_id, "--json"]).stdout)["run"]["parent"] == {
        "run_id": a.run_id, "step": 3}
    # the parent's own store does not know its fork: the registry does
    assert show_run(a.run_id)["forks"] == [{"run_id": fork.run_id, "step": 3}]
    assert f"forks      {fork.run_id}@3" in runner.invoke(app, ["runs", "show", a.run_id]).stdout
    assert show_run(b.run_id)["forks"] == []


def test_ls_has_no_parent_column_without_forks(runs_tree):
    lines = runner.invoke(app, ["runs", "ls"]).stdout.splitlines()
    assert "PARENT" not in lines[0]


def test_cli_ls_global_on_an_empty_registry_is_an_empty_array(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["runs", "ls", "--global", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == []


def test_cli_ls_usage_errors(runs_tree):
    result = runner.invoke(app, ["runs", "ls", "--status", "zombie"])
    assert result.exit_code == 1
    assert "unknown status 'zombie'" in result.output
    result = runner.invoke(app, ["runs", "ls", "--limit", "-3"])
    assert result.exit_code == 2


def test_cli_show_text_json_and_errors(runs_tree):
    a, _, _ = runs_tree
    result = runner.invoke(app, ["runs", "show", a.run_id])
    assert result.exit_code == 0, result.output
    assert f"run        {a.run_id}" in result.stdout
    assert "optimizer.lr = 0.0003" in result.stdout
    result = runner.invoke(app, ["runs", "show", a.run_id, "--json", "--global"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["run"]["store"].endswith("experiments.db")
    result = runner.invoke(app, ["runs", "show", "../secret"])
    assert result.exit_code == 1
    assert "invalid run id" in result.output
    assert "Traceback" not in result.output


def test_fast_path_answers_ls_and_declines_the_rest(runs_tree, capsys):
    assert fast_path(["runs", "ls", "--json", "--global"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    assert fast_path(["runs", "ls", "--status", "failed"]) is None
    assert fast_path(["runs", "show", "x"]) is None
    assert fast_path(["train", "validate", "x.yaml"]) is None


def test_the_ledger_gives_each_skipped_rows_recorded_loss(tmp_path, monkeypatch):
    """A bad step skipped at a logged step: its rows' losses (apr runs blame's records) join the ledger."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    run_id, now = "20261128-000000-1ed9e1", time.time()
    rows = [{"micro_batch": 20, "index": 7, "shard": "shard-00000.parquet", "row": 7},
            {"micro_batch": 20, "index": 9, "shard": "shard-00000.parquet", "row": 9}]
    w = StoreWriter(out / ".apr" / "experiments.db")
    w.write(Batch(run={"id": run_id, "experiment": "exp", "status": "finished", "started": now, "output_dir": str(out),
                       "step": 30, "total_steps": 30}, register={"params": {}},
                  events=[(run_id, 21, now, "bad_step", "skipped", json.dumps({"rows": rows})),
                          (run_id, 25, now, "bad_step", "skipped",
                           json.dumps({"rows": [{**rows[0], "micro_batch": 24}]}))],
                  row_losses=[(run_id, 21, 20, 7, None, "shard-00000.parquet", 7, 9.5),
                              (run_id, 21, 20, 9, None, "shard-00000.parquet", 9, 2.25),
                              (run_id, 21, 20, 11, None, "shard-00000.parquet", 11, 2.0)]))
    w.close()
    result = runner.invoke(app, ["runs", "ledger", run_id, "--format", "json"])
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout)
    assert [(e["step"], e["index"], e["loss"]) for e in entries] == [(21, 7, 9.5), (21, 9, 2.25), (25, 7, None)]
    table = runner.invoke(app, ["runs", "ledger", run_id]).stdout.splitlines()
    assert table[0].split()[-1] == "LOSS" and table[1].split()[-1] == "9.5000" and table[3].split()[-1] == "–"
