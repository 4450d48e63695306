"""`apr export` through the CLI (the command module is apr/cli/cmd_export.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr.checkpoint.manager import CheckpointManager, TrainState
from apr.cli.main import app
from tests.checkpoint.conftest import make_config, make_tensors
from tests.checkpoint.test_export import ARCH, tokenizer_file  # noqa: F401  (fixture)

runner = CliRunner()


def test_export_writes_a_hf_folder(tmp_path, tokenizer_file):  # noqa: F811
    config = make_config(**ARCH, **{"data.tokenizer": str(tokenizer_file)})
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(3, make_tensors(config), {}))
    out = tmp_path / "hf"
    res = runner.invoke(app, ["export", str(ckpt), "--format", "hf", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "step 3" in res.output and "model.safetensors" in res.output
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"

    res = runner.invoke(app, ["export", str(ckpt), "--out", str(out)])  # exists, not empty
    assert res.exit_code == 1
    assert "--overwrite" in res.output and "Traceback" not in res.output


def test_export_errors_and_usage(tmp_path):
    res = runner.invoke(app, ["export", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1
    # the one weight-source reader's refusal (docs/checkpoints.md, "Weight sources"), naming the file
    assert "source.missing" in res.output and "missing.json" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["export", str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "source.no_checkpoint" in res.output and "got an empty folder" in res.output


def test_export_never_replaces_a_device_or_a_fifo(tmp_path, tokenizer_file):  # noqa: F811
    import os
    import stat

    config = make_config(**ARCH, **{"data.tokenizer": str(tokenizer_file)})
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(3, make_tensors(config), {}))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    inode = os.stat("/dev/null").st_ino
    for out in ("/dev/null", str(fifo)):
        for extra in ([], ["--overwrite"]):
            res = runner.invoke(app, ["export", str(ckpt), "--out", out, *extra])
            assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and os.stat("/dev/null").st_ino == inode
    assert stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.slow  # a subprocess that imports torch: several seconds on a loaded 2-core machine
def test_a_read_only_target_or_a_file_size_limit_is_an_error_and_leaves_the_earlier_export(
        tmp_path, tokenizer_file):  # noqa: F811
    import os
    import shutil
    import subprocess
    import sys

    config = make_config(**ARCH, **{"data.tokenizer": str(tokenizer_file)})
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(3, make_tensors(config), {}))
    parent = tmp_path / "exports"
    out = parent / "hf"
    assert runner.invoke(app, ["export", str(ckpt), "--out", str(out)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # EFBIG: a file-size limit far below the weights, in a subprocess (the limit is per process)
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))\n"
            "from apr.cli.main import app\n"
            f"sys.argv = ['apr', 'export', {str(ckpt)!r}, '--out', {str(out)!r}, '--overwrite']\n"
            "app()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "--out" in done.stderr and "File too large" in done.stderr and "Traceback" not in done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in parent.iterdir()) == ["hf"]  # no temp folder left
    # a read-only parent folder (immutable for root)
    parent.chmod(0o555)
    root = os.geteuid() == 0
    if root and (not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(parent)],
                                                               capture_output=True).returncode != 0):
        parent.chmod(0o755)
        pytest.skip("running as root without chattr: cannot make a folder read-only")
    try:
        res = runner.invoke(app, ["export", str(ckpt), "--out", str(out), "--overwrite"])
        res2 = runner.invoke(app, ["export", str(ckpt), "--out", str(parent / "new")])
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(parent)], check=False)
        parent.chmod(0o755)
    for r in (res, res2):
        assert r.exit_code == 1 and "--out" in r.output and "Traceback" not in r.output, r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
