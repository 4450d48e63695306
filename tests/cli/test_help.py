"""Help reads like a well-kept CLI: no Python types, no braces in usage lines (issue 24 item 10)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()
COMMANDS = [["train", "validate"], ["train", "plan"], ["train", "apply"], ["data", "train-tokenizer"],
            ["data", "pretokenize"], ["data", "synth"], ["runs", "ls"], ["runs", "show"], ["experiment", "view"],
            ["experiment", "export"], ["monitor"], ["export"], ["schema"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_has_metavars_not_python_types(command):
    result = runner.invoke(app, [*command, "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    text = result.output
    assert not re.search(r"<(str|int|float|path|list\[\w+\]|int range|float range)[^>]*>", text), text
    assert "{" not in text.splitlines()[0] and "x>=" not in text and "x<=" not in text, text


def test_metavars_say_what_a_value_is():
    plan = runner.invoke(app, ["train", "plan", "--help"], terminal_width=120).output
    assert plan.splitlines()[0].endswith("[OPTIONS] CONFIG [KEY=VALUE]...")
    assert "--world-size N " in plan and "[N >= 1]" in plan and "--vram SIZE" in plan
    tok = runner.invoke(app, ["data", "train-tokenizer", "--help"], terminal_width=120).output
    assert "[INPUTS]..." in tok.splitlines()[0] and "--vocab-size SIZE" in tok and "--out FILE" in tok
    apply = runner.invoke(app, ["train", "apply", "--help"], terminal_width=120).output
    assert "--device auto|cpu|cuda" in apply and "--max-steps N " in apply
