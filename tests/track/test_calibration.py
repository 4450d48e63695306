"""The calibration store (apr/track/calibration.py): one malformed row is skipped and named, never a
crash of every plan and apply; finished runs teach a probe-based estimate their actual / estimated
ratio, net of the load change; the range widens with their spread."""

from __future__ import annotations

import json
import math
import sqlite3

import pytest
from typer.testing import CliRunner

from apr import __version__
from apr.cli.main import app
from apr.track import calibration
from apr.track.names import global_db_path

runner = CliRunner()

SHAPE = {"architecture": {"num_hidden_layers": 2, "hidden_size": 32}, "batch_size": 4, "seq_len": 16}


def _probe(tokens_per_s=1000.0, steps=(0.1, 0.11, 0.09), load=0.5, **extra) -> dict:
    return {"source": "probe", "device": "cpu", "device_name": calibration.host_cpu_name(),
            "versions": {"torch": calibration.torch_version(), "cuda": None, "apr": __version__, "python": "3"},
            "tokens_per_s": tokens_per_s, "step_seconds": sorted(steps)[1], "step_seconds_all": list(steps),
            "startup_seconds": 2.0, "load": load, "threads": 2, "rows": [], **extra}


def _run(actual, base, load_factor=None, **extra) -> dict:
    return {**_probe(), "source": "run", "run_id": "r", "actual_seconds": actual, "base_seconds": base,
            "base_kind": "probe", "load_factor": load_factor, **extra}


def _corrupt(row_id: int, column: str, value) -> None:
    with sqlite3.connect(global_db_path()) as conn:
        conn.execute(f"UPDATE calibrations SET {column} = ? WHERE id = ?", (value, row_id))


BAD = [
    ("result", "{not json", "result is not valid JSON"),
    ("result", "[1, 2]", "result is list, expected a JSON object"),
    ("result", json.dumps({**_probe(), "tokens_per_s": "fast"}), "result.tokens_per_s is 'fast'"),
    ("result", json.dumps({**_probe(), "tokens_per_s": 0}), "result.tokens_per_s is 0"),
    ("result", json.dumps({**_probe(), "step_seconds_all": [0.1, None]}), "step_seconds_all"),
    ("result", json.dumps({**_probe(), "source": "guess"}), "result.source is 'guess'"),
    ("result", json.dumps({**_probe(), "rows": [{"component": "x"}]}), "result.rows"),
    ("result", json.dumps({**_probe(), "startup_seconds": "soon"}), "result.startup_seconds"),
    ("shape", json.dumps({"batch_size": 4}), "shape.architecture"),
    ("shape", "null", "shape is NoneType"),
    ("time", "yesterday", "time is 'yesterday'"),
    ("device_name", None, "device_name is null"),
]


@pytest.mark.parametrize(("column", "value", "reason"), BAD, ids=[f"{c}-{r[:18]}" for c, _, r in BAD])
def test_a_malformed_row_is_skipped_and_named(column, value, reason):
    good = calibration.record(_probe(), SHAPE)
    bad = calibration.record(_probe(tokens_per_s=5.0), SHAPE)
    _corrupt(bad, column, value)
    rows = calibration.list_calibrations()
    assert [r["id"] for r in rows] == [good]
    (warning,) = calibration.skipped_warnings()
    assert warning.startswith(f"calibration row {bad} skipped: ") and reason in warning
    assert calibration.summary(rows)["tokens_per_s"] == 1000.0


def test_plan_and_calibration_ls_survive_a_malformed_row(tmp_path):
    from apr.config import load_config
    from apr.plan.facts import cpu_threads
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    policy = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)["run"]["execution"]["policy"]
    config = load_config(cfg).config
    calibration.record(_probe(), calibration.shape(config, policy, cpu_threads(config, 1)["threads"]))
    _corrupt(1, "result", "{torn")  # the row this plan would read
    plan = runner.invoke(app, ["train", "plan", str(cfg)])
    assert plan.exit_code == 0 and "Traceback" not in plan.output
    assert "warning: calibration row 1 skipped: result is not valid JSON" in plan.stdout
    doc = json.loads(runner.invoke(app, ["train", "plan", str(cfg), "--json"]).stdout)
    assert doc["facts"]["calibration_skipped"] == [calibration.skipped_warnings()[0]]
    listed = runner.invoke(app, ["calibration", "ls"])
    assert listed.exit_code == 0 and "calibration row 1 skipped" in listed.output and "Traceback" not in listed.output


def test_an_unreadable_registry_is_a_warning_not_a_crash():
    path = global_db_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not sqlite" * 100)
    assert calibration.list_calibrations() == []
    assert "cannot be read" in calibration.skipped_warnings()[0]


def test_finished_runs_correct_a_probe_net_of_the_load_change():
    rows = [{"id": 1, "time": 1.0, "device_name": "cpu", "result": _probe()}]
    plain = calibration.summary(rows)
    assert plain["basis"] == "probe" and plain["correction"] is None and plain["what"] == "1 probe"
    assert plain["spread"] == pytest.approx(math.log(0.1 / 0.09))  # the farthest step from the median
    # two runs took 1.2x and 1.5x their estimates; the second ran on cores 1.25x busier than probed
    rows += [{"id": 2, "time": 2.0, "device_name": "cpu", "result": _run(12.0, 10.0)},
             {"id": 3, "time": 3.0, "device_name": "cpu", "result": _run(15.0, 10.0, load_factor=1.25)}]
    corrected = calibration.summary(rows)["correction"]
    assert corrected["ratios"] == pytest.approx([1.2, 1.2]) and corrected["raw_factor"] == pytest.approx(1.2)
    # two runs say little: shrunk toward 1 by n / (n + 1), the distance counted as uncertainty
    assert corrected["factor"] == pytest.approx(1.2 ** (2 / 3))
    assert corrected["spread"] == pytest.approx(math.log(1.2) / math.sqrt(3))
    assert calibration.summary(rows)["what"] == "1 probe, corrected by 2 finished runs"


def test_the_basis_is_the_median_of_the_latest_probes():
    rates = [1000.0, 100.0, 900.0, 1100.0]  # the second probe hit a load spike
    rows = [{"id": i, "time": float(i), "device_name": "cpu", "result": _probe(tokens_per_s=r, load=float(i))}
            for i, r in enumerate(rates)]
    assert calibration.summary(rows[:2])["tokens_per_s"] == pytest.approx(550.0)
    three = calibration.summary(rows)
    assert three["tokens_per_s"] == 900.0 and three["what"] == "the median of the last 3 probes"
    assert three["load"] == 2.0 and three["basis_time"] == 3.0


def test_only_the_recent_runs_count_and_runs_alone_give_their_own_spread():
    runs = [{"id": i, "time": float(i), "device_name": "cpu",
             "result": _run(10.0 * (3.0 if i < 5 else 1.1), 10.0, tokens_per_s=900.0 + i)} for i in range(20)]
    probe = {"id": 99, "time": 0.5, "device_name": "cpu", "result": _probe()}
    corrected = calibration.summary([probe, *runs])["correction"]
    assert corrected["runs"] == calibration.RECENT and corrected["raw_factor"] == pytest.approx(1.1)
    alone = calibration.summary(runs)  # no probe: the runs' own tokens/s, their scatter the range
    assert alone["basis"] == "run" and alone["correction"] is None and alone["spread"] > 0
    assert alone["tokens_per_s"] == pytest.approx(sorted(900.0 + i for i in range(12, 20))[3:5][0] / 2
                                                  + sorted(900.0 + i for i in range(12, 20))[3:5][1] / 2)


def test_ls_and_show_put_a_runs_actual_time_beside_its_estimate():
    calibration.record(_run(135.6, 60.0, estimated_seconds=66.3, low_seconds=25.9, high_seconds=169.4,
                            inside_range=True), SHAPE)
    listed = runner.invoke(app, ["calibration", "ls"])
    assert listed.exit_code == 0 and "136/66 s in" in listed.stdout
    shown = runner.invoke(app, ["calibration", "show", "1"])
    assert "135.6 s actual against ~66.3 s estimated (range 25.9-169.4 s: inside)" in shown.stdout
    assert json.loads(runner.invoke(app, ["calibration", "ls", "--json"]).stdout)[0]["inside_range"] is True


def test_apply_survives_a_malformed_row_and_records_its_own(tmp_path):
    from apr.apply import run_apply
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 12})
    assert run_apply(cfg, echo=lambda line: None).status == "finished"  # the first run: one good row
    (row,) = calibration.list_calibrations()
    _corrupt(row["id"], "result", json.dumps({**row["result"], "tokens_per_s": float("nan")}).replace("NaN", "1e999"))
    (tmp_path / "run").rename(tmp_path / "run-1")
    assert run_apply(cfg, echo=lambda line: None).status == "finished"
    rows = calibration.list_calibrations()
    assert [r["id"] for r in rows] == [row["id"] + 1]  # the new run's row; the torn one skipped and named
    assert calibration.skipped_warnings() == [f"calibration row {row['id']} skipped: result.tokens_per_s is inf, "
                                              "expected a positive number"]
