"""The dashboard definition: the default is today's layout (and the one docs/monitor.md shows), a
custom file lays out the terminal app and the browser's tabs alike, and a bad file is refused with
its line before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.cli.main import app as cli
from apr.fmt import fmt_sci
from apr.monitor.dashboard import DEFAULT_YAML, DashboardError, default_dashboard, load_dashboard
from apr.monitor.web import dashboard_command

from .conftest import FIXTURES
from .test_app import drive, fixture_app, text

CUSTOM = """\
rows:
  - height: 1fr
    panels:
      - loss
      - {panel: spark, metric: tokens_per_s, title: Throughput, width: 30}
  - height: 5
    panels: [alerts]
"""


def test_the_default_is_the_layout_the_docs_show():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "monitor.md").read_text()
    assert DEFAULT_YAML in docs
    d = default_dashboard()
    assert [[p.id for c in r.cells for p in c.panels] for r in d.rows] == [
        ["loss", "stats", "gpu"], ["lr", "grad", "blocks"], ["messages"]]


def test_a_custom_layout_shows_its_panels_and_only_them(tmp_path):
    path = tmp_path / "dash.yaml"
    path.write_text(CUSTOM)
    app = fixture_app("mid_run", dashboard=load_dashboard(path))

    async def body(pilot):
        assert not app.query("#stats") and not app.query("#lr") and not app.query("#gpu")
        spark = app.query_one("#spark-0")
        assert spark.border_title == "Throughput" and spark.outer_size.width == 30
        history = json.loads((FIXTURES / "mid_run" / "training_state.json").read_text())["tokens_per_s_history"]
        assert f"now {fmt_sci(history[-1][1])}" in text(app, "#spark-0")  # the fixture's tokens_per_s
        assert "step 6,900 gradient_norm > 2" in text(app, "#messages")

    drive(app, body, size=(100, 30))


@pytest.mark.parametrize("yaml, message, line", [
    ("rows:\n  - panels:\n      - {panel: spark, metric: toks}\n", "metric 'toks' does not exist", 3),
    ("rows:\n  - panels: [loss, losses]\n", "no panel 'losses'", 2),
    ("rows:\n  - panels: [loss]\n  - panels: [loss]\n", "the loss panel appears twice", 3),
    ("rows:\n  - height: tall\n    panels: [loss]\n", "not a size", 2),
    ("rows: []\n", "no rows", 1),
])
def test_a_bad_file_is_refused_with_its_line(tmp_path, yaml, message, line):
    path = tmp_path / "dash.yaml"
    path.write_text(yaml)
    with pytest.raises(DashboardError) as err:
        load_dashboard(path)
    assert message in err.value.message and err.value.findings[0].line == line


def test_the_cli_refuses_a_bad_file_before_starting_and_the_web_passes_a_good_one_on(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rows:\n  - panels: [{panel: spark, metric: perplexity}]\n")
    result = CliRunner().invoke(cli, ["monitor", str(FIXTURES / "mid_run"), "--dashboard", str(bad)])
    assert result.exit_code == 1 and "metric 'perplexity' does not exist" in result.stderr
    assert "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["monitor", str(FIXTURES / "mid_run"), "--dashboard", str(bad), "--json"])
    assert result.exit_code == 2
    good = tmp_path / "good.yaml"
    good.write_text(CUSTOM)
    assert f"--dashboard {good.resolve()}" in dashboard_command(FIXTURES / "mid_run", None, None, good)


HIST_EVALS = """\
rows:
  - height: 6
    panels: [hist, evals]
  - height: 4
    panels: [alerts]
"""


def test_the_histogram_and_eval_panels_show_the_recorded_layers_and_scores_by_stage(tmp_path):
    """hist: one line per layer (embedding to head) with its weight and gradient histograms; evals: the
    last evaluation of each stage as bars, oldest first."""
    import shutil

    from apr.monitor.app import MonitorApp
    from apr.monitor.settings import MonitorSettings

    from .test_app import fixed_clock

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "mid_run", run)
    doc = json.loads((run / "training_state.json").read_text())

    def layer(name, kind, counts, span):
        return {"name": name, "kind": kind, "lo": -span, "hi": span, "min": -span, "max": span / 2, "counts": counts}

    names = ["head", "block.1", "embed", "block.0"]  # recorded in any order, shown in the model's
    doc["histograms"] = {"step": 12800, "bins": 4, "layers": [
        layer(n, k, [0, 5, 9, 1], 0.5 if k == "weight" else 0.02) for n in names for k in ("weight", "grad")]}
    doc["eval_history"] = [{"step": s, "stage": st, "scores": {"nextline": a}}
                           for s, st, a in ((1000, "warmup", 0.1), (2000, "warmup", 0.2), (9000, "main", 0.6))]
    (run / "training_state.json").write_text(json.dumps(doc))
    path = tmp_path / "dash.yaml"
    path.write_text(HIST_EVALS)
    app = MonitorApp(run, settings=MonitorSettings(), clock=fixed_clock, dashboard=load_dashboard(path))

    async def body(pilot):
        hist = text(app, "#hist").splitlines()  # the gradient's largest magnitude ends each line
        assert [line.split()[0] for line in hist] == ["embed", "block.0", "block.1", "head"]
        assert all(" w " in line and " g " in line and line.endswith(" ±0.020") for line in hist)
        assert app.query_one("#hist").border_title == "Histograms @ step 12800"
        evals = text(app, "#evals").splitlines()
        assert [line.split()[0] for line in evals] == ["warmup", "main"]
        assert evals[0].endswith("20.0%") and evals[1].endswith("60.0%") and "@2,000" in evals[0]

    drive(app, body, size=(100, 12))


@pytest.mark.parametrize("yaml, message", [
    ("rows:\n  - height: 100000000000000000000\n    panels: [loss]\n", "too large"),  # grew until killed
    ("rows:\n  - height: 1e20\n    panels: [loss]\n", "not a size"),
    ("rows:\n  - height: " + "9" * 5000 + "\n    panels: [loss]\n", "too large to read"),  # past int-from-text
    ("rows:\n  - height: " + "9" * 5000 + "fr\n    panels: [loss]\n", "too large"),
    ("rows:\n  - height: 4\n    panels: [{panel: loss, width: 1001}]\n", "too large"),
    ("rows:\n  - panels: [{column: [{column: [loss]}]}]\n", "not a panel"),
    ("rows:\n  - panels: [{panel: spark, metric: [1, 2], title: {a: 1}}]\n", "does not exist"),
    ("rows:\n  - panels: [{panel: {a: 1}}]\n", "not a panel"),
    ("[" * 40 + "]" * 40, "nests too deeply"),
])
def test_a_hostile_file_is_refused_at_once_without_a_traceback(tmp_path, yaml, message):
    path = tmp_path / "dash.yaml"
    path.write_text(yaml)
    result = CliRunner().invoke(cli, ["monitor", str(FIXTURES / "mid_run"), "--dashboard", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and message in " ".join(result.output.split()), result.output
    assert "9" * 100 not in result.output  # a long value is described, not printed


@pytest.mark.parametrize("text_, hidden", [
    ("root:$6$SECRETHASH$xyz:19000:0:99999:7:::\n", "SECRETHASH"),  # a shadow line: one string
    ("API_KEY=SECRETKEY\n", "SECRETKEY"),
    ("password: SECRETPW\n", "SECRETPW"),  # a mapping, but not a dashboard's
    ("rows:\n  - panels: [SECRETPANEL_" + "x" * 60 + "]\n", "SECRETPANEL"),  # a long value of a dashboard
])
def test_a_file_that_is_not_a_dashboard_is_refused_without_quoting_it(tmp_path, text_, hidden):
    path = tmp_path / "dash.yaml"
    path.write_text(text_)
    with pytest.raises(DashboardError) as err:
        load_dashboard(path)
    rendered = err.value.message + json.dumps([f.to_dict() for f in err.value.findings])
    assert hidden not in rendered and "not shown" in rendered
