"""A full disk (or quota, or read-only file system) while saving a checkpoint (issue 24 item 18): a
clear error naming the file and the space needed, and the previous checkpoint intact."""

from __future__ import annotations

import errno
from collections import namedtuple

import pytest

from apr import fsutil
from apr.checkpoint import manager as manager_module
from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState
from apr.plan.build import resolve_config
from tests.checkpoint.conftest import make_tensors


def _state(config, step):
    return TrainState(step=step, tensors=make_tensors(config, step), meta={"epoch": 0})


def _fail_writes(monkeypatch, code):
    """Every file the atomic writer opens fails its first write with ``code``, as a full disk does."""
    real_open = open

    class Failing:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(code, "injected")

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def failing_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Failing(f) if "w" in mode else f

    monkeypatch.setattr(fsutil, "open", failing_open, raising=False)


@pytest.mark.parametrize("code, what", [(errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "quota"),
                                        (errno.EROFS, "read-only"), (errno.EFBIG, "largest file")])
def test_a_failed_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, tiny_config, monkeypatch,
                                                                        code, what):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(_state(tiny_config, 5))
    before = sorted(p.name for p in tmp_path.iterdir())
    _fail_writes(monkeypatch, code)
    with pytest.raises(CheckpointError) as err:
        mgr.save(_state(tiny_config, 10))
    monkeypatch.undo()
    message = err.value.message
    assert err.value.reason == "disk_full" and what in message and "checkpoint-step-10.safetensors" in message
    assert "needs about" in message and "--resume latest" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp file left, step 5 untouched
    assert CheckpointManager(tmp_path, tiny_config).load("latest")[0].step == 5


def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path, tiny_config, monkeypatch):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(_state(tiny_config, 5))
    before = sorted(p.name for p in tmp_path.iterdir())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(manager_module.shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 4096))
    with pytest.raises(CheckpointError, match=r"not enough free space .*4\.00 KiB is free") as err:
        mgr.save(_state(tiny_config, 10))
    assert err.value.reason == "disk_full"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_run_whose_disk_fills_fails_cleanly_and_resumes_from_the_last_checkpoint(tmp_path, monkeypatch):
    import json

    from apr.checkpoint import files
    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.run import ApplyOptions, prepare_run
    from tests.train.run_helpers import config_doc, make_dataset

    make_dataset(tmp_path)
    cfg = AprConfig.model_validate(config_doc(tmp_path, training={"max_steps": 4, "save_interval": 2}))
    real = files.write_safetensors

    def full_at_step_4(path, *args, **kwargs):
        if "checkpoint-step-4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "write_safetensors", full_at_step_4)
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                      options=ApplyOptions(echo=lambda line: None))
    with pytest.raises(CheckpointError, match="the disk is full") as err:
        run.execute()
    assert "checkpoint-step-4.safetensors" in err.value.message
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert state["status"] == "failed" and "the disk is full" in state["status_reason"]
    monkeypatch.undo()
    assert CheckpointManager(tmp_path / "run", cfg).load("latest")[0].step == 2


@pytest.mark.slow  # a subprocess that imports torch: several seconds on a loaded 2-core machine
def test_a_file_size_limit_while_saving_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    """A real EFBIG: RLIMIT_FSIZE far below the weights, in a subprocess (SIGXFSZ ignored, as a
    file system's own size limit gives EFBIG without a signal)."""
    import subprocess
    import sys

    code = f"""
import resource, signal, sys
from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState
from tests.checkpoint.conftest import make_config, make_tensors
config = make_config()
mgr = CheckpointManager({str(tmp_path)!r}, config)
mgr.save(TrainState(step=5, tensors=make_tensors(config, 5), meta={{"epoch": 0}}))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    mgr.save(TrainState(step=10, tensors=make_tensors(config, 10), meta={{"epoch": 0}}))
except CheckpointError as err:
    print(err.reason, err.message)
    sys.exit(1)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("disk_full") and "largest file" in done.stdout and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-step-5.json", "checkpoint-step-5.safetensors"]
