"""One output folder, one writer: the lock, and a fresh run kept out of another run's files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from run_helpers import config_doc, make_dataset

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.train.outdir import LOCK_FILE, OutputDirLock, refuse_foreign_files
from apr.train.run import ApplyOptions, prepare_run

REPO = Path(__file__).resolve().parent.parent.parent


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the folder's lock, says so, and sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from apr.train.outdir import OutputDirLock
        lock = OutputDirLock(Path({str(run_dir)!r}))
        lock.acquire(Path("cfg.yaml"))
        print("locked", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_with_the_holders_pid_and_host_and_kill_9_frees_the_folder(tmp_path):
    run_dir = tmp_path / "run"
    holder = _hold_lock(run_dir)
    try:
        with pytest.raises(AprError, match="in use by another apr run") as err:
            OutputDirLock(run_dir).acquire(tmp_path / "cfg.yaml")
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(err.value)
        assert err.value.findings[0].path == "training.output_dir"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock = OutputDirLock(run_dir)
    lock.acquire(tmp_path / "cfg.yaml")  # the kernel dropped the dead holder's lock
    assert str(os.getpid()) in (run_dir / LOCK_FILE).read_text()
    lock.release()


def _prepare(root: Path, resume=None, **sections):
    cfg = AprConfig.model_validate(config_doc(root, **sections))
    opts = ApplyOptions(resume=resume, echo=lambda line: None)
    return prepare_run(cfg, config_hash=config_hash(cfg), config_path=root / "cfg.yaml", options=opts)


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    return tmp_path


def test_a_run_holds_the_lock_until_it_ends(root):
    first = _prepare(root, training={"max_steps": 2})
    with pytest.raises(AprError, match=f"pid {os.getpid()}"):
        _prepare(root, training={"max_steps": 2})
    assert first.execute().status == "finished"
    again = _prepare(root, resume="latest", training={"max_steps": 4})  # free again
    assert again.execute().final_step == 4


def test_a_busy_folder_is_refused_before_the_model_is_built_or_the_data_read(root, monkeypatch):
    """A second apply must not take memory (a GPU's) from the run that holds the folder."""
    first = _prepare(root, training={"max_steps": 2})
    built: list[str] = []
    monkeypatch.setattr("apr.train.run.engine_build.build_engine", lambda *a, **k: built.append("engine"))
    monkeypatch.setattr("apr.train.run.data_side", lambda *a, **k: built.append("data"))
    with pytest.raises(AprError, match="in use by another apr run"):
        _prepare(root, training={"max_steps": 2})
    assert built == []
    first.lock.release()


def test_a_folder_holding_only_checkpoint_best_is_in_use(root):
    _prepare(root, training={"max_steps": 4}).execute()
    run_dir = root / "run"
    for p in run_dir.glob("checkpoint-step-*"):
        p.unlink()
    best = (run_dir / "checkpoint-best.safetensors").read_bytes()
    with pytest.raises(AprError, match="already holds checkpoints.*checkpoint-best"):
        _prepare(root, training={"max_steps": 4})
    assert (run_dir / "checkpoint-best.safetensors").read_bytes() == best
    assert _prepare(root, training={"max_steps": 2, "output_dir": str(root / "elsewhere")}).execute().exit_code == 0


def test_a_users_config_yaml_in_the_output_dir_is_never_overwritten(root):
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("# my own notes\nmodel: {}\n")
    with pytest.raises(AprError, match="not a config apr wrote") as err:
        _prepare(root, training={"max_steps": 2})
    assert err.value.findings[0].code == "apply.output_dir_config"
    assert (run_dir / "config.yaml").read_text() == "# my own notes\nmodel: {}\n"
    assert not (run_dir / "training_state.json").exists()


def test_refuse_foreign_files_names_what_it_found(tmp_path):
    refuse_foreign_files(tmp_path / "absent", tmp_path / "cfg.yaml")  # nothing there: fine
    (tmp_path / "checkpoint-step-7.safetensors").write_bytes(b"partial")  # a crash mid-save still counts
    with pytest.raises(AprError, match="checkpoint-step-7.safetensors"):
        refuse_foreign_files(tmp_path, tmp_path / "cfg.yaml")
