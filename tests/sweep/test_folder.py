"""The sweep's folder (apr/sweep/folder.py): one sweep's, checked like a run's output_dir, and never
a place whose files a sweep would mix with or replace (issue 54 item 2). No trial trains here: each
command is refused before its first trial, or the worker runs invalid trials only."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.sweep.folder import MARKER, claim_folder, folder_problems, write_report
from apr.sweep.planning import sweep_dir
from apr.sweep.results import REPORT_FILES, metric_svg
from apr.sweep.runner import prepare
from apr.sweep.spec import SweepError, load_sweep
from tests.sweep.sweep_helpers import tiny_root, write_sweep

runner = CliRunner()
GRID = """
config: cfg.yaml
method: grid
parameters:
  model.architecture.num_attention_heads: {{values: [{heads}]}}
"""


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_root(tmp_path)
    write_sweep(tmp_path, GRID.format(heads="3, 5"), "a.yaml")
    write_sweep(tmp_path, GRID.format(heads="7"), "b.yaml")
    return tmp_path


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(args: list[str], words: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    text = " ".join(result.output.split())
    assert "Traceback" not in text and any(w in text for w in words.split("|")), result.output
    return result.output


def test_a_second_sweep_given_the_same_folder_is_refused_before_it_touches_it(root):
    a = load_sweep(root / "a.yaml")
    prepare(a, root / "D", None, None)  # sweep a's folder: its record, storage
    assert (root / "D" / MARKER).is_file()
    (root / "D" / "best.yaml").write_text(f"# the best trial (0, val_loss 1.0) of sweep {a.name}, on cfg.yaml\n")
    before = _hashes(root / "D")
    out = _refused(["sweep", "run", str(root / "b.yaml"), "--dir", str(root / "D")], "is the folder of sweep a")
    assert "error[sweep.folder_in_use]" in out
    assert _hashes(root / "D") == before  # no trial folder, no study, no report of sweep b
    prepare(a, root / "D", None, None)  # sweep a itself (a worker of it, or the same command again) goes on


def test_a_folder_holding_sweep_files_of_no_recorded_sweep_is_refused(root):
    folder = root / "U"
    folder.mkdir()
    (folder / "best.yaml").write_text("my own notes\n")
    (folder / "metric_vs_params.svg").write_text("<svg>mine</svg>\n")
    before = _hashes(folder)
    _refused(["sweep", "run", str(root / "a.yaml"), "--dir", str(folder)], "holds best.yaml, metric_vs_params.svg")
    assert _hashes(folder) == before and not (folder / MARKER).exists()


def test_a_folder_of_an_earlier_version_holding_this_sweeps_storage_is_taken_over(root):
    a = load_sweep(root / "a.yaml")
    prepare(a, root / "D", None, None)
    os.unlink(root / "D" / MARKER)  # as an apr before the record left it: study.db of this sweep, no record
    claim_folder(a, root / "D")
    assert (root / "D" / MARKER).is_file()
    os.unlink(root / "D" / MARKER)
    with pytest.raises(SweepError, match="of no sweep apr recorded"):
        claim_folder(load_sweep(root / "b.yaml"), root / "D")  # another sweep's storage: refused


def test_reports_replace_only_what_this_sweep_wrote(root):
    a = load_sweep(root / "a.yaml")
    folder = root / "D"
    claim_folder(a, folder)
    plot = folder / REPORT_FILES["plot"]
    write_report(plot, metric_svg([], a), a)
    write_report(plot, metric_svg([], a), a)  # its own earlier plot: replaced
    user = folder / REPORT_FILES["best_config"]
    user.write_text("my best config, by hand\n")
    with pytest.raises(SweepError, match="not a report of sweep a"):
        write_report(user, "# the best trial ...\n", a)
    assert user.read_text() == "my best config, by hand\n"
    with pytest.raises(SweepError, match="not a report of sweep a"):  # and the next run is refused up front
        claim_folder(a, folder)
    user.unlink()
    config = (root / "cfg.yaml").read_bytes()
    os.symlink(root / "cfg.yaml", user)  # a symlink in its place is never written through
    with pytest.raises(SweepError):
        write_report(user, "# the best trial\n", a)
    assert (root / "cfg.yaml").read_bytes() == config and user.is_symlink()


@pytest.mark.parametrize("where, words", [
    ("/", "is a filesystem root"),
    ("APR_HOME", "apr's own"),
    ("data/train", "is data.train"),
    ("data/train/inner", "is inside data.train"),
    ("run", "is a training run's folder"),
    ("/dev/null", "is a device"),
    ("fifo", "is a FIFO"),
    ("file", "is a file|is a regular file"),
])
def test_a_folder_that_can_never_be_a_sweeps_is_refused_by_plan_and_run(root, where, words):
    if where == "APR_HOME":
        where = os.environ["APR_HOME"]
    elif where == "run":
        (root / "run").mkdir()
        (root / "run" / "training_state.json").write_text('{"schema_version": 3, "run_id": "r"}')
    elif where == "fifo":
        os.mkfifo(root / "fifo")
    elif where == "file":
        (root / "file").write_text("a file of the user's\n")
    before = _hashes(root)
    _refused(["sweep", "run", str(root / "a.yaml"), "--dir", where], words)
    write_sweep(root, GRID.format(heads="3") + f"output_dir: {where}\n", "c.yaml")
    out = _refused(["sweep", "plan", str(root / "c.yaml")], words)
    assert "output_dir" in out and "c.yaml:" in "".join(out.split())  # at the file's key, with its line
    assert {k: v for k, v in _hashes(root).items() if k != "c.yaml"} == before


def test_a_fresh_folder_and_the_default_one_are_fine(root):
    a = load_sweep(root / "a.yaml")
    assert folder_problems(a, sweep_dir(a)) == []
    assert folder_problems(a, root / "new" / "sweep") == []
