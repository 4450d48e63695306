"""`apr train fork` on the command line: a refusal is exit 1 with the checkpoints there, no traceback."""

from __future__ import annotations

from typer.testing import CliRunner

from apr.cli.main import app


def test_a_folder_that_is_no_run_is_refused_with_exit_1(tmp_path):
    result = CliRunner().invoke(app, ["train", "fork", str(tmp_path), "--at", "2"])
    assert result.exit_code == 1
    assert "is not an apr run folder" in result.output and "Traceback" not in result.output


def test_a_step_without_a_checkpoint_names_the_ones_there(tmp_path):
    (tmp_path / "config.yaml").write_text("model: {}\n")
    result = CliRunner().invoke(app, ["train", "fork", str(tmp_path), "--at", "7"])
    assert result.exit_code == 1
    assert "no checkpoint at step 7; checkpoints there: none" in result.output
