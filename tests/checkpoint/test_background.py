"""Background checkpoint writes (training.checkpoint_async): the same bytes as a synchronous save,
one write in flight, the snapshot taken before the caller changes its tensors, a failed write raised
in the caller, and a run whose files equal a synchronous run's."""

from __future__ import annotations

import errno
import json
import threading

import pytest

from apr import fsutil
from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState
from tests.checkpoint.conftest import make_tensors


def _state(config, step):
    return TrainState(step=step, tensors=make_tensors(config, step), meta={"epoch": 0})


def test_a_background_save_writes_the_bytes_a_synchronous_save_writes(tmp_path, tiny_config):
    sync, bg = CheckpointManager(tmp_path / "sync", tiny_config), CheckpointManager(tmp_path / "bg", tiny_config)
    sync.save(_state(tiny_config, 4), is_best=True)
    state = _state(tiny_config, 4)
    path = bg.save(state, is_best=True, background=True)
    for t in state.tensors.values():  # the trainer goes on changing its tensors at once
        t.add_(1.0)
    assert bg.wait() == [(4, path, True)] and bg.collect() == []
    for name in ("checkpoint-step-4.safetensors", "checkpoint-best.safetensors"):
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "bg" / name).read_bytes()
    a = json.loads((tmp_path / "sync" / "checkpoint-step-4.json").read_text())
    b = json.loads(path.read_text())
    assert a["weights_sha256"] == b["weights_sha256"]


def test_one_write_in_flight_a_second_save_waits_for_the_first(tmp_path, tiny_config, monkeypatch):
    mgr = CheckpointManager(tmp_path, tiny_config, keep_last=5)
    gate, real_write = threading.Event(), mgr._write
    order = []

    def slow_write(state, step, *args):
        order.append(("start", step))
        if step == 1:
            assert gate.wait(10)
        out = real_write(state, step, *args)
        order.append(("end", step))
        return out

    monkeypatch.setattr(mgr, "_write", slow_write)
    mgr.save(_state(tiny_config, 1), background=True)
    threading.Timer(0.2, gate.set).start()
    mgr.save(_state(tiny_config, 2), background=True)  # blocks until step 1 is on disk
    assert order[:2] == [("start", 1), ("end", 1)]
    assert [s for s, _, _ in mgr.wait()] == [1, 2]


def test_a_failed_background_write_raises_in_the_caller_and_keeps_the_previous(tmp_path, tiny_config, monkeypatch):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(_state(tiny_config, 5))
    real_open = open

    def full(path, mode="r", *a, **kw):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "injected")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(fsutil, "open", full, raising=False)
    mgr.save(_state(tiny_config, 10), background=True)
    with pytest.raises(CheckpointError) as err:
        mgr.wait()
    monkeypatch.undo()
    assert err.value.reason == "disk_full" and "checkpoint-step-10.safetensors" in err.value.message
    assert CheckpointManager(tmp_path, tiny_config).load("latest")[0].step == 5


def test_a_run_with_background_checkpoints_writes_what_a_synchronous_run_writes(tmp_path):
    from apr.apply import run_apply
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    files = {}
    for name, on in (("bg", True), ("sync", False)):
        cfg = write_config(tmp_path, name=f"{name}.yaml", training={"checkpoint_async": on,
                                                                    "output_dir": f"{name}/"})
        result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
        assert result.status == "finished"
        state = json.loads((tmp_path / name / "training_state.json").read_text())
        assert state["last_checkpoint"]["step"] == 12
        files[name] = {p.name: p.read_bytes() for p in (tmp_path / name).glob("checkpoint-*.safetensors")}
    assert files["bg"].keys() == files["sync"].keys() and len(files["bg"]) >= 3
    assert all(files["bg"][k] == files["sync"][k] for k in files["bg"])
