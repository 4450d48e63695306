"""`apr train validate` gives the warmup warning (C-TRAINCFG-004) that `apr train plan` gives when
the config alone decides it: ``training.max_steps`` in the file (issue 54 item 9)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app
from tests.train.run_helpers import make_dataset, write_config

runner = CliRunner()


def _warmup(args: list[str]) -> list[dict]:
    r = runner.invoke(app, [*args, "--json"])
    return [f for f in json.loads(r.stdout)["findings"] if f["code"] == "C-TRAINCFG-004"]


def test_validate_warns_of_a_long_warmup_as_plan_does_when_max_steps_is_in_the_file(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"warmup_steps": 4, "max_steps": 12})
    validated, planned = _warmup(["train", "validate", str(cfg)]), _warmup(["train", "plan", str(cfg)])
    assert len(validated) == 1 and validated[0]["severity"] == "warning"
    assert "warmup is 33.3% of the run (4 of 12 steps)" in validated[0]["message"]
    assert [(f["message"], f["path"], f["line"]) for f in validated] == [
        (f["message"], f["path"], f["line"]) for f in planned]  # the same finding, at the same line


def test_validate_says_nothing_of_a_short_warmup_or_without_max_steps(tmp_path):
    make_dataset(tmp_path)
    short = write_config(tmp_path, "short.yaml", training={"warmup_steps": 1, "max_steps": 12})
    assert _warmup(["train", "validate", str(short)]) == []
    open_ended = write_config(tmp_path, "open.yaml", training={"warmup_steps": 4, "max_steps": None})
    assert _warmup(["train", "validate", str(open_ended)]) == []  # the run's length is the data's: plan judges
