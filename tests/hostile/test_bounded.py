"""Bounded everything (issue 39, hostile 6): numbers too large for a store, extreme or non-finite
command-line numbers, and odd output targets end in a clear error naming the option (or are kept
exactly), never in a traceback or lost records."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def test_an_int_past_64_bits_reaching_the_stores_keeps_every_record(tmp_path, monkeypatch):
    """A seed of 2**64 passed validation once and lost the whole run's records (SQLite integers are
    64-bit); validate refuses it now, and the stores keep such a value as text, read back exactly."""
    from apr.track import store
    from apr.track.recorder import RunRecorder
    from tests.track.track_helpers import make_config

    home = tmp_path / "home"
    monkeypatch.setenv("APR_HOME", str(home))
    cfg = make_config()
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"seed": 2**64 + 5})})
    rec = RunRecorder(tmp_path / "run", cfg, config_hash="c0ffee", total_steps=3, tokens_per_step=64,
                      apr_home=home, background=False)
    rec.start()
    for step in (1, 2, 3):
        rec.log_step(step, {"loss": 4.0 - step})
    rec.finish("finished")
    for db in (home / "experiments.db", tmp_path / "run" / ".apr" / "experiments.db"):
        conn = store.connect_readonly(db)
        try:
            assert store.run_params(conn, rec.run_id)["training.seed"] == 2**64 + 5
            assert [v for _, v in store.metric_series(conn, rec.run_id, "loss")] == [3.0, 2.0, 1.0]
            assert store.get_run(conn, rec.run_id)["status"] == "finished"
        finally:
            conn.close()
    assert store._typed(-(2**63)) == (-(2**63), "int") and store._typed(2**63) == (str(2**63), "int")


@pytest.mark.parametrize("option,value", [
    ("--max-new-tokens", "-5"), ("--max-new-tokens", "0"), ("--temperature", "nan"), ("--temperature", "inf"),
    ("--temperature", "-1"), ("--top-p", "nan"), ("--top-p", "2"), ("--top-k", "-3"),
    ("--repetition-penalty", "inf"), ("--repetition-penalty", "0"), ("--seed", str(2**64)), ("--seed", "-1"),
])
def test_generate_refuses_numbers_it_cannot_use_before_loading(tmp_path, option, value):
    r = runner.invoke(app, ["generate", str(tmp_path / "no-model"), "-p", "hi", option, value])
    assert r.exit_code == 1, r.output
    assert option in r.output and "Traceback" not in r.output and "no-model" not in r.output


def test_generate_takes_a_huge_max_new_tokens_as_the_context_limit():
    """--max-new-tokens 10**30 is not refused: generation stops at the model's context."""
    from apr.generate.generate import GenerateOptions

    assert GenerateOptions(max_new_tokens=10**30).max_new_tokens == 10**30


@pytest.mark.parametrize("args,option", [
    (["--steps", str(10**30)], "--steps"), (["--steps", "-1"], "--steps"), (["--min-lr", "inf"], "--min-lr"),
    (["--max-lr", "nan"], "--max-lr"), (["--smoothing", "1"], "--smoothing"), (["--diverge", "nan"], "--diverge"),
])
def test_lr_find_refuses_extreme_numbers_before_any_work(args, option):
    from apr.lrfind import RangeTest, range_findings

    kw = {"--steps": "steps", "--min-lr": "min_lr", "--max-lr": "max_lr", "--smoothing": "smoothing",
          "--diverge": "diverge"}
    value = float(args[1]) if option != "--steps" else int(args[1])
    found = range_findings(RangeTest(**{kw[option]: value}))
    assert [f.path for f in found] == [option], found


@pytest.fixture(scope="module")
def odd_root(tmp_path_factory):
    from apr.plan.examples import materialize

    root = tmp_path_factory.mktemp("odd")
    config, _ = materialize({"config": {"training": {"warmup_steps": 0}}}, root / "w")
    (root / "afile").write_text("the user's file\n")
    return root, config


def _odd_output_dir(root, kind: str) -> str:
    return {"a_file": str(root / "afile"), "under_a_file": str(root / "afile" / "run"),
            "too_long": str(root / ("n" * 300))}[kind]


@pytest.mark.parametrize("kind", ["a_file", "under_a_file", "too_long"])
def test_lr_find_refuses_an_odd_output_dir_before_the_sweep(odd_root, kind):
    root, config = odd_root
    r = runner.invoke(app, ["train", "lr-find", str(config), "--steps", "10",
                            f"training.output_dir={_odd_output_dir(root, kind)}"])
    assert r.exit_code == 1 and "--plot" in r.output and "Traceback" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert (root / "afile").read_text() == "the user's file\n"


@pytest.mark.parametrize("kind", ["a_file", "under_a_file"])
def test_apply_and_plan_take_an_odd_output_dir_without_a_traceback(odd_root, kind):
    root, config = odd_root
    setting = f"training.output_dir={_odd_output_dir(root, kind)}"
    planned = runner.invoke(app, ["train", "plan", str(config), setting])
    assert planned.exception is None or isinstance(planned.exception, SystemExit), planned.output
    applied = runner.invoke(app, ["train", "apply", str(config), setting])
    assert applied.exit_code == 1 and "training.output_dir" in applied.output, applied.output
    assert applied.exception is None or isinstance(applied.exception, SystemExit)
    assert (root / "afile").read_text() == "the user's file\n"


# ---------------------------------------------------------------- issue 54 item 3: tracebacks, one per class

@pytest.mark.parametrize("setting, key", [
    ("data.drift.seed=-1", "data.drift.seed"),  # passed validate, crashed plan in numpy
    ("monitoring.data_drift.seed=-1", "monitoring.data_drift.seed"),
    ("training.max_steps=" + "9" * 100_000, "training.max_steps"),  # past Python's int-from-text limit
    ("training.max_steps=" + "[" * 5_000, "training.max_steps"),  # the YAML parser's recursion
    ("training.max_steps=" + "[" * 2_000 + "]" * 2_000, "training.max_steps"),  # under the length cap
    ("training.max_steps=" + "- " * 2_000, "training.max_steps"),  # block nesting
])
def test_a_setting_past_what_apr_reads_is_an_error_at_its_key_not_a_traceback(odd_root, setting, key):
    _root, config = odd_root
    for command in ("validate", "plan"):
        r = runner.invoke(app, ["train", command, str(config), setting])
        assert r.exit_code == 1 and key in r.output, (command, r.output[-500:])
        assert r.exception is None or isinstance(r.exception, SystemExit), (command, r.exception)
        assert len(r.output) < 2_000  # the value is never echoed


def test_lr_find_refuses_a_rate_past_what_an_update_can_hold():
    from apr.lrfind import RangeTest, range_findings

    (found,) = range_findings(RangeTest(max_lr=1e300))
    assert found.path == "--max-lr" and "at most 1,000" in found.expected
    assert range_findings(RangeTest(max_lr=10.0)) == []


def test_runs_ls_into_a_reader_that_left_exits_quietly(tmp_path):
    """`apr runs ls | head -1` printed a BrokenPipeError traceback (the fast path skips click)."""
    import os
    import subprocess
    import sys

    from apr.track.recorder import RunRecorder
    from tests.track.track_helpers import make_config

    home = tmp_path / "home"
    rec = RunRecorder(tmp_path / "run", make_config(), config_hash="c0ffee", total_steps=1, tokens_per_step=64,
                      apr_home=home, background=False)
    rec.start()
    rec.finish("finished")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    env = {**os.environ, "APR_HOME": str(home)}
    for args in (["runs", "ls", "--global"], ["runs", "ls", "--global", "--json"], ["runs", "ls", "--global",
                                                                                        "--limit", "5"]):
        code = "import sys; from apr.cli.entry import run; sys.argv = ['apr', *sys.argv[1:]]; run()"
        done = subprocess.run([sys.executable, "-c", code, *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)
        assert done.returncode == 1 and done.stderr == "", (args, done.stderr[-500:])
    os.close(write)


def test_cache_ls_reads_metadata_nested_deeply_or_holding_odd_values(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("APR_HOME", str(tmp_path))
    tokens = tmp_path / "cache" / "tokens"
    tokens.mkdir(parents=True)
    nested, odd = "0123456789abcdef" * 2, "f" * 32
    (tokens / f"{nested}.json").write_text("[" * 100_000 + "]" * 100_000)
    (tokens / f"{nested}.u32").write_bytes(b"\0" * 8)
    (tokens / f"{odd}.json").write_text(json.dumps({"source": "a\0b" + "x" * 5000, "rows": [[[1]]] * 50,
                                                    "row_len": 10**30}))
    for args in (["cache", "ls"], ["cache", "ls", "--json"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0 and r.exception is None, r.output[-500:]
        assert "x" * 300 not in r.output and "[[1]]" not in r.output
    assert "no readable metadata" in runner.invoke(app, ["cache", "ls"]).output


def test_plan_probe_with_a_damaged_calibration_table_warns_and_plans(tmp_path, monkeypatch, capsys):
    """The probe's result could not be stored (a calibrations table of another shape): a traceback."""
    import sqlite3
    from types import SimpleNamespace

    import apr.probe
    from apr.cli.cmd_train_plan import probe_plan

    monkeypatch.setenv("APR_HOME", str(tmp_path))
    with sqlite3.connect(tmp_path / "experiments.db") as db:
        db.execute("CREATE TABLE calibrations (x TEXT)")
    db.close()
    result = {"device": "cpu", "threads": 2, "tokens_per_s": 1.0}
    monkeypatch.setattr(apr.probe, "run_probe", lambda *a, **k: dict(result))
    monkeypatch.setattr(apr.probe, "one_process_rows", lambda *a, **k: [])
    from tests.track.track_helpers import make_config

    plan = SimpleNamespace(config=make_config(), execution={"policy": {}}, world_size=1)
    rebuilt = SimpleNamespace(facts={})
    out = probe_plan(plan, 3, lambda: rebuilt)
    assert out is rebuilt and out.facts["probe"]["calibration_id"] is None
    err = capsys.readouterr().err
    assert "could not be kept in the calibration store" in err and str(tmp_path / "experiments.db") in err


def test_a_task_file_gold_of_5001_digits_is_a_line_error():
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from apr.errors import AprError
    from apr.evaluate.tasks import read_task

    with TemporaryDirectory() as d:
        task = Path(d) / "t.jsonl"
        task.write_text('{"context": "x", "choices": [" a", " b"], "gold": ' + "9" * 5001 + "}\n")
        with pytest.raises(AprError) as err:
            read_task(task)
    assert err.value.findings[0].line == 1 and "9" * 50 not in str(err.value.findings[0])


def test_experiment_export_into_a_read_only_folder_is_refused_before_writing(tmp_path, monkeypatch):
    import os

    from apr.track.recorder import RunRecorder
    from tests.track.track_helpers import make_config

    rec = RunRecorder(tmp_path / "run", make_config(), config_hash="c0ffee", total_steps=2, tokens_per_step=64,
                      apr_home=tmp_path / "home", background=False)
    rec.start()
    rec.log_step(1, {"loss": 3.0})
    rec.finish("finished")
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    # root writes anywhere: the folder is read-only to os.access, as it is to a user
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) and mode & os.W_OK
                        else real_access(p, mode))
    for out in (ro, ro / "tb"):
        r = runner.invoke(app, ["experiment", "export", "--db", str(tmp_path / "run" / ".apr" / "experiments.db"),
                                "--to", "tensorboard", "--out", str(out)])
        assert r.exit_code == 1 and "read-only" in r.output and "--out" in r.output, r.output[-800:]
        assert r.exception is None or isinstance(r.exception, SystemExit)
    assert list(ro.iterdir()) == []
