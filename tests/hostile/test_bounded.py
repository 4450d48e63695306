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
