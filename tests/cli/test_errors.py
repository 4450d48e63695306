"""One place renders errors: an AprError from any command is printed once (one coded line
`error[code] ...` carrying its message, or `error: ...` above several findings), exits with its code
and no traceback; --debug re-raises it (issue 13 item 8, issue 54 item 10)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from apr.cli.main import app
from apr.errors import AprError

runner = CliRunner()
CLI = Path(__file__).resolve().parents[2] / "apr" / "cli"


def test_a_command_error_is_printed_once_with_its_exit_code(tmp_path):
    result = runner.invoke(app, ["experiment", "view", "--db", str(tmp_path / "none.db")])
    assert result.exit_code == 1
    assert result.output.count("no experiment store") == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error[experiment.no_store]") and "Traceback" not in result.output


def test_debug_re_raises_the_error(tmp_path):
    result = runner.invoke(app, ["--debug", "experiment", "view", "--db", str(tmp_path / "none.db")])
    assert isinstance(result.exception, AprError)


def test_only_render_formats_error_lines():
    offenders = [p.name for p in CLI.glob("*.py") if p.name != "render.py"
                 and re.search(r"""["']error: \{""", p.read_text())]
    assert offenders == []


def test_cli_files_follow_one_naming_scheme():
    helpers = {"__init__.py", "main.py", "entry.py", "help.py", "render.py", "table.py", "progress.py",
               "streams.py", "ghactions.py"}
    names = {p.name for p in CLI.glob("*.py")} - helpers
    assert all(n.startswith("cmd_") for n in names), sorted(names)


def test_an_error_with_one_finding_is_one_line_carrying_both_messages_once():
    import io

    from apr.cli.render import print_error
    from apr.errors import Finding

    def shown(error_message, **finding):
        out = io.StringIO()
        print_error(AprError(error_message, [Finding("error", "x.y", **finding)]), out)
        return out.getvalue()

    # the error's message says all the finding's does: one line, the location not repeated
    line = shown("data/t.jsonl:3: gold must be an index into choices", message="gold must be an index into choices",
                 file="data/t.jsonl", line=3, path="gold", expected="0..1", got="5")
    assert line == "error[x.y] data/t.jsonl:3 gold: gold must be an index into choices (expected 0..1, got 5)\n"
    # each says something the other does not: both, once
    line = shown("t.jsonl:1: a number too long (pass --on-error skip)", message="longer than 4,300 digits",
                 file="t.jsonl", line=1)
    assert line == "error[x.y] t.jsonl:1: a number too long (pass --on-error skip); longer than 4,300 digits\n"
    # a count header ("1 schema error") gives way to the finding it counts
    assert shown("config.yaml: 1 schema error", message="expected a seed", path="data.drift.seed",
                 file="command line") == "error[x.y] command line data.drift.seed: expected a seed\n"
    # several findings: the message heads them
    out = io.StringIO()
    print_error(AprError("config.yaml: 2 schema errors", [Finding("error", "a.b", "one"),
                                                          Finding("error", "a.b", "two")]), out)
    assert out.getvalue().splitlines() == ["error: config.yaml: 2 schema errors", "error[a.b] one", "error[a.b] two"]
