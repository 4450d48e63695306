"""`apr export` through the CLI (the command module is apr/cli/cmd_export.py)."""

from __future__ import annotations

import json

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
    assert "checkpoint.missing" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["export", str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "no checkpoint in" in res.output


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
