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


# A KEY.PATH=VALUE override as help and docs write it (`optimizer.lr=1e-3`); `key.path=value` is the
# generic form, not an example.
_OVERRIDE = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=([^\s`'\"),;]*)")
_GENERIC = {"key.path"}


def _help_texts():
    """(where, text) of every command's docstring and every parameter's help, unwrapped."""
    import typer

    def walk(command, path):
        yield " ".join(path) or "apr", command.help or ""
        for param in command.params:
            yield f"{' '.join(path)} {param.name}", getattr(param, "help", None) or ""
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    yield from walk(typer.main.get_command(app), [])


def _doc_texts(repo):
    for page in [*sorted((repo / "docs").glob("*.md")), repo / "README.md"]:
        yield str(page.relative_to(repo)), page.read_text()
    for module in ("apr/config/layers.py", "apr/config/loader.py", "apr/cli/cmd_train_apply.py",
                   "apr/cli/cmd_train_plan.py", "apr/cli/cmd_train_validate.py"):
        yield module, (repo / module).read_text()


def test_every_override_example_in_help_and_docs_names_a_key_and_a_valid_value(repo):
    """Examples users copy must work: each KEY=VALUE in a --help text or a docs page names a key the
    schema knows, and (unless its value is a placeholder such as PRICE) loads against the schema."""
    from apr.config import load_config
    from apr.config.loader import schema_key_paths
    from apr.errors import ConfigError

    known = {".".join(p) for p in schema_key_paths()}
    base = repo / "configs/train/demo-tiny.yaml"
    seen, problems = 0, []
    for where, text in [*_help_texts(), *_doc_texts(repo)]:
        for key, value in _OVERRIDE.findall(text):
            if key in _GENERIC:
                continue
            seen += 1
            if key not in known:
                problems.append(f"{where}: {key}={value}: no such key")
                continue
            if not value or value.isupper() or value[0] in "[{<":
                continue  # a placeholder (PRICE, SIZE) or a value the regex cannot take whole
            try:
                load_config(base, [f"{key}={value}"])
            except ConfigError as e:
                problems.append(f"{where}: {key}={value}: {e.findings[0].message if e.findings else e.message}")
    assert seen >= 5, "the examples were not found: is the pattern still right?"
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_unknown_key_in_an_example():
    assert _OVERRIDE.findall("apply cfg.yaml (training.lr=1e-3) and `optimizer.lr=1e-3`") == [
        ("training.lr", "1e-3"), ("optimizer.lr", "1e-3")]
    from apr.config.loader import schema_key_paths

    assert ("training", "lr") not in schema_key_paths() and ("optimizer", "lr") in schema_key_paths()
