"""apr.track.experiment and `apr experiment view/export` (through CliRunner, no TTY)."""

import math

import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from track_helpers import make_config
from typer.testing import CliRunner

from apr.cli.main import app
from apr.errors import AprError
from apr.track.experiment import export_run, load_view, param_table, render_bars, render_chart, resolve_db

runner = CliRunner()


@pytest.fixture
def sweep(tmp_path, recorder_factory, _private_apr_home):
    """Two runs of one experiment with different learning rates, in the global registry."""
    recs = []
    for i, lr in enumerate((1e-3, 3e-3)):
        cfg = make_config(optimizer={"lr": lr})
        rec = recorder_factory(tmp_path / f"lr{i}", cfg=cfg, experiment="sweep", background=False,
                               run_id=f"20261122-00000{i}-abcde{i}")
        rec.start()
        for s in range(1, 61):
            rec.log_step(s, {"loss": 5 * math.exp(-s * lr * 10) + 1, "lr": lr})
            if s % 20 == 0:
                rec.log_eval(s, 2.0 - s / 100)
        rec.finish("finished")
        recs.append(rec)
    return recs, _private_apr_home / "experiments.db"


def test_db_may_be_a_file_a_run_folder_or_apr_home(tmp_path, sweep):
    recs, registry = sweep
    assert resolve_db(registry) == registry
    assert resolve_db(registry.parent) == registry
    assert resolve_db(recs[0].output_dir) == recs[0].output_dir / ".apr" / "experiments.db"
    with pytest.raises(AprError):
        resolve_db(tmp_path / "nothing")


def test_view_loads_curves_and_the_params_that_differ(sweep):
    recs, registry = sweep
    view = load_view(registry, metric="loss")
    assert [s.run_id for s in view.series] == [recs[1].run_id, recs[0].run_id]  # newest first
    assert [p[0] for p in view.series[0].points] == list(range(1, 61))
    header, rows, hidden = param_table(view)
    assert header == ["param", recs[1].run_id, recs[0].run_id]
    assert rows == [["optimizer.lr", "0.003", "0.001"]]
    assert hidden > 50
    _, all_rows, none_hidden = param_table(view, all_params=True)
    assert none_hidden == 0 and len(all_rows) == len(rows) + hidden
    one = load_view(registry, runs=[recs[0].run_id], metric="val_loss")
    assert [p for p in one.series[0].points] == [(20, 1.8), (40, 1.6), (60, 1.4)]


def test_long_curves_are_decimated_but_keep_their_ends(sweep):
    _, registry = sweep
    view = load_view(registry, metric="loss", max_points=10)
    pts = view.series[0].points
    assert len(pts) <= 11 and pts[0][0] == 1 and pts[-1][0] == 60


def test_chart_renders_without_a_terminal(sweep):
    recs, registry = sweep
    text = render_chart(load_view(registry), width=80, height=20)
    assert "\x1b[" not in text
    assert "loss by step" in text
    assert recs[0].run_id in text and recs[1].run_id in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_export_csv_and_parquet_hold_every_step_and_metric(tmp_path, sweep):
    recs, registry = sweep
    rid = recs[0].run_id
    res = export_run(registry, rid, "parquet", tmp_path / "out" / "m.parquet")
    table = pq.read_table(res.path)
    assert table.column_names == ["step", "time", "loss", "lr", "val_loss", "val_ppl"]
    assert table.num_rows == 60
    d = table.to_pydict()
    assert d["step"] == list(range(1, 61))
    assert d["loss"][0] == pytest.approx(5 * math.exp(-0.01) + 1)
    assert d["val_loss"][19] == pytest.approx(1.8) and d["val_loss"][18] is None
    res = export_run(registry, rid[:-1], "csv", tmp_path / "m.csv")
    assert pcsv.read_csv(res.path).to_pydict()["loss"] == pytest.approx(d["loss"])
    assert not list(tmp_path.glob(".m.csv.*"))  # no temp file left behind
    with pytest.raises(AprError):
        export_run(registry, rid, "xlsx", tmp_path / "m.xlsx")
    with pytest.raises(AprError):
        export_run(registry, "20991231-000000-ffffff", "csv", tmp_path / "n.csv")


def test_cli_view_and_export(tmp_path, sweep):
    recs, registry = sweep
    result = runner.invoke(app, ["experiment", "view", "--db", str(registry), "--params", "--width", "90"])
    assert result.exit_code == 0, result.output
    assert "loss by step" in result.stdout and "optimizer.lr" in result.stdout
    assert "\x1b[" not in result.stdout
    result = runner.invoke(app, ["experiment", "view", "--db", str(registry), "--runs",
                                 f"{recs[0].run_id},nope-1", "--metric", "lr"])
    assert result.exit_code == 1 and "no run 'nope-1'" in result.output

    out = tmp_path / "x.csv"
    result = runner.invoke(app, ["experiment", "export", "--db", str(registry), "--run", recs[1].run_id,
                                 "--format", "csv", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "wrote 60 rows" in result.stdout and out.is_file()
    result = runner.invoke(app, ["experiment", "export", "--db", str(registry), "--run", recs[1].run_id,
                                 "--format", "xlsx", "--output", str(out)])
    assert result.exit_code == 2
    result = runner.invoke(app, ["experiment", "export", "--db", str(tmp_path / "none.db"), "--run", "r1",
                                 "--format", "csv", "--output", str(out)])
    assert result.exit_code == 1 and "no experiment store" in result.output


@pytest.fixture
def two_experiments(tmp_path, sweep, recorder_factory):
    recs, registry = sweep
    other = recorder_factory(tmp_path / "other", cfg=make_config(), experiment="distill", background=False,
                             run_id="20261122-000009-zzzzz9")
    other.start()
    other.log_step(1, {"loss": 9.0})
    other.finish("finished")
    return recs, other, registry


def test_view_selects_runs_by_experiment_name(two_experiments):
    recs, other, registry = two_experiments
    assert [s.run_id for s in load_view(registry).series][0] == other.run_id  # newest of all
    assert [s.run_id for s in load_view(registry, experiment="sweep").series] == [recs[1].run_id, recs[0].run_id]
    with pytest.raises(AprError) as err:
        load_view(registry, experiment="sweeep")
    assert err.value.findings[0].expected == "one of distill, sweep"
    with pytest.raises(AprError, match="is not in experiment 'sweep'"):
        load_view(registry, runs=[other.run_id], experiment="sweep")


def test_bar_chart_shows_each_runs_last_value_in_proportion(two_experiments):
    recs, _, registry = two_experiments
    text = render_bars(load_view(registry, experiment="sweep", metric="val_loss"), width=80)
    lines = text.splitlines()
    assert lines[0] == "val_loss: last value per run"
    assert [ln.split()[0] for ln in lines[1:]] == [recs[1].run_id, recs[0].run_id]
    assert all(ln.endswith(" 1.4") and "@60" in ln for ln in lines[1:])
    assert lines[1].count("█") == lines[2].count("█") > 0


def test_cli_view_by_experiment_from_the_global_registry(two_experiments):
    recs, other, _ = two_experiments
    result = runner.invoke(app, ["experiment", "view", "--experiment", "distill", "--chart", "bar", "--width", "80"])
    assert result.exit_code == 0, result.output
    assert other.run_id in result.stdout and recs[0].run_id not in result.stdout and "9" in result.stdout
    result = runner.invoke(app, ["experiment", "view", "-e", "sweep", "--chart", "loss_curve", "--width", "80"])
    assert result.exit_code == 0 and "loss by step" in result.stdout
    result = runner.invoke(app, ["experiment", "view", "--experiment", "nope"])
    assert result.exit_code == 1 and "no experiment 'nope'" in result.stderr and "Traceback" not in result.output


@pytest.fixture
def forked(sweep, recorder_factory, tmp_path):
    """The sweep's first run forked at step 30 (a lower lr), and that fork forked again at 45."""
    recs, registry = sweep
    forks, parent = [], recs[0]
    for i, at in enumerate((30, 45)):
        rec = recorder_factory(tmp_path / f"fork{i}", experiment="sweep", background=False,
                               run_id=f"20261122-00001{i}-f0f0f{i}")
        rec.start(resume_step=at)
        rec.log_event("fork", at, "forked", {"parent": {"run_id": parent.run_id, "step": at}})
        for s in range(at + 1, 61):
            rec.log_step(s, {"loss": 0.5 + i / 10})
        rec.finish("finished")
        forks.append(rec)
        parent = rec
    return recs, forks, registry


def test_view_with_forks_overlays_a_run_and_its_forks(forked):
    recs, forks, registry = forked
    view = load_view(registry, runs=[recs[0].run_id], forks=True)
    assert [s.run_id for s in view.series] == [recs[0].run_id, forks[0].run_id, forks[1].run_id]
    assert view.series[1].points[0] == (31, 0.5)  # a fork's curve starts after its fork step
    assert view.label(forks[1].run_id) == f"{forks[1].run_id} (fork of {forks[0].run_id}@45)"
    assert [s.run_id for s in load_view(registry, runs=[recs[0].run_id]).series] == [recs[0].run_id]
    result = runner.invoke(app, ["experiment", "view", "--db", str(registry), "--runs", recs[0].run_id[:-1],
                                 "--forks", "--width", "160"])
    assert result.exit_code == 0, result.output
    assert f"{forks[0].run_id} (fork of {recs[0].run_id}@30)" in result.stdout
    assert recs[1].run_id not in result.stdout  # another run of the experiment, not a fork
