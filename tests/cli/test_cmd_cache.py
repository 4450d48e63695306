"""`apr cache ls` / `apr cache prune`: what a user sees and what is left on disk; bad options are
clean errors (exit 1, no traceback) that remove nothing."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app
from tests.track.test_caches import _tokens

runner = CliRunner()


def test_ls_and_prune_by_age_through_the_cli(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("APR_HOME", str(home))
    _tokens(home, "0" * 32, tmp_path, age_days=45)
    _tokens(home, "1" * 32, tmp_path, age_days=2)
    listed = runner.invoke(app, ["cache", "ls"], terminal_width=160)
    assert listed.exit_code == 0 and "45 d ago" in listed.output and "2 entries" in listed.output
    doc = json.loads(runner.invoke(app, ["cache", "ls", "--json", "--kind", "tokens"]).output)
    assert doc["bytes"] == sum(e["bytes"] for e in doc["entries"]) and len(doc["entries"]) == 2
    dry = runner.invoke(app, ["cache", "prune", "--older-than", "30", "--dry-run"])
    assert dry.exit_code == 0 and "would remove 1 of 2 entries" in dry.output
    assert len(list((home / "cache" / "tokens").iterdir())) == 6
    done = json.loads(runner.invoke(app, ["cache", "prune", "--older-than", "30", "--json"]).output)
    assert [e["key"] for e in done["removed"]] == ["0" * 32] and done["freed_bytes"] > 4000
    assert [e["key"] for e in json.loads(runner.invoke(app, ["cache", "ls", "--json"]).output)["entries"]] == ["1" * 32]


def test_prune_needs_one_rule_and_bad_values_remove_nothing(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("APR_HOME", str(home))
    _tokens(home, "a" * 32, tmp_path, age_days=90)
    for args, says in ((["cache", "prune"], "got none"), (["cache", "prune", "--all", "--gone"], "--all and --gone"),
                       (["cache", "prune", "--older-than", "-1"], "days >= 0"),
                       (["cache", "prune", "--older-than", "nan"], "days >= 0"),
                       (["cache", "prune", "--all", "--kind", "weights"], "tokens, teacher, inductor")):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and says in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert len(list((home / "cache" / "tokens").iterdir())) == 3
    assert runner.invoke(app, ["cache", "prune", "--all"]).exit_code == 0
    assert not any((home / "cache" / "tokens").iterdir())
    empty = runner.invoke(app, ["cache", "ls"])
    assert empty.exit_code == 0 and "no cache entries" in empty.output
