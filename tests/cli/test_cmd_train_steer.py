"""`apr train steer` on the command line: a request file for a run folder, or exit 1 naming the keys."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app


def test_a_request_is_written_for_the_run_to_apply(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    result = CliRunner().invoke(app, ["train", "steer", str(tmp_path), "lr_factor=0.5", "training.log_interval=5"])
    assert result.exit_code == 0, result.output
    (request,) = (tmp_path / "steer").glob("*.json")
    assert json.loads(request.read_text())["changes"] == {"lr_factor": 0.5, "training.log_interval": 5}


def test_a_key_that_cannot_be_steered_is_exit_1_with_the_steerable_ones(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    result = CliRunner().invoke(app, ["train", "steer", str(tmp_path), "model.architecture.hidden_size=8"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cannot be steered in a live run; steerable keys: lr_factor, training.grad_clip" in result.output
