"""`apr experiment view/export`: the asked width wins, a damaged store is a clear error, and export
never writes over a device, a FIFO, the store it reads or an existing file without --overwrite
(issue 24 items 6, 12, 20)."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest
from test_experiment import sweep  # noqa: F401  (fixture)
from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def test_view_width_wins_when_piped(sweep):  # noqa: F811
    _, registry = sweep
    result = runner.invoke(app, ["experiment", "view", "--db", str(registry), "--width", "150"])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) == 150


@pytest.mark.parametrize("damage,commands", [("UPDATE metrics SET value = 'high'", ("view", "export")),
                                             ("DROP TABLE metrics", ("view", "export")),
                                             ("DROP TABLE params", ("view",))])
def test_a_damaged_store_is_a_clear_error_for_view_and_export(tmp_path, sweep, damage, commands):  # noqa: F811
    recs, registry = sweep
    conn = sqlite3.connect(registry)
    conn.execute(damage)
    conn.commit()
    conn.close()
    for args in (["view", "--db", str(registry)],
                 ["export", "--db", str(registry), "--run", recs[0].run_id, "--format", "csv",
                  "--out", str(tmp_path / "m.csv")]):
        if args[0] not in commands:
            continue
        result = runner.invoke(app, ["experiment", *args])
        assert result.exit_code == 1, result.output
        assert str(registry) in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m.csv").exists()


def _export(sweep, out, *extra):  # noqa: F811
    recs, registry = sweep
    return runner.invoke(app, ["experiment", "export", "--db", str(registry), "--run", recs[0].run_id,
                               "--format", "csv", "--out", str(out), *extra])


def test_export_refuses_a_fifo_and_a_device(tmp_path, sweep):  # noqa: F811
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    result = _export(sweep, fifo, "--overwrite")
    assert result.exit_code == 1 and "is a FIFO" in result.output and "Traceback" not in result.output
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    before = os.stat("/dev/null")
    result = _export(sweep, "/dev/null", "--overwrite")
    assert result.exit_code == 1 and "is a device" in result.output
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_export_refuses_to_write_over_its_own_store(sweep):  # noqa: F811
    _, registry = sweep
    size = registry.stat().st_size
    result = _export(sweep, registry, "--overwrite")
    assert result.exit_code == 1 and "is an input of this command" in result.output
    assert registry.stat().st_size == size
    conn = sqlite3.connect(registry)
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 2
    conn.close()


def test_export_replaces_an_existing_file_only_with_overwrite(tmp_path, sweep):  # noqa: F811
    out = tmp_path / "m.csv"
    out.write_text("keep")
    result = _export(sweep, out)
    assert result.exit_code == 1 and "--overwrite" in result.output and out.read_text() == "keep"
    result = _export(sweep, out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith('"step","time"')
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_export_out_and_output_together_is_a_usage_error(tmp_path, sweep):  # noqa: F811
    result = _export(sweep, tmp_path / "a.csv", "--output", str(tmp_path / "b.csv"))
    assert result.exit_code == 2 and "--out once" in result.output
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "b.csv").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_file_mode_follows_the_umask_like_a_plain_open(tmp_path, sweep):  # noqa: F811
    old = os.umask(0o027)
    try:
        result = _export(sweep, tmp_path / "m.csv")
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m.csv").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777 == 0o640


def test_view_width_wins_in_a_real_pipe(sweep):  # noqa: F811
    """A real process whose stdout is a pipe (no terminal, no COLUMNS): what `| less` sees."""
    import subprocess
    import sys
    from pathlib import Path

    _, registry = sweep
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "apr", "experiment", "view", "--db", str(registry), "--width", "150"],
                         capture_output=True, stdin=subprocess.DEVNULL, env=env, text=True,  # stdout: a pipe
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) == 150
