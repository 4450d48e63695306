"""One place renders errors: an AprError from any command is printed once as `error: ...` plus its
findings, exits with its code and no traceback; --debug re-raises it (issue 13 item 8)."""

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
    assert result.output.count("error: no experiment store") == 1
    assert "error[experiment.no_store]" in result.output and "Traceback" not in result.output


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
