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
from apr.plan.build import resolve_config
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
    return prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml", options=opts)


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


# ---------------------------------------------------------- a resume allowed into another run's folder
def _other_run_folder(folder: Path, steps=(2, 4), best=True, records=True) -> dict[str, bytes]:
    """A folder as run "c" leaves it: its checkpoints' JSON (with its run id), and its records."""
    import json

    from apr.checkpoint.files import step_stem

    folder.mkdir(parents=True, exist_ok=True)
    for step in steps:
        (folder / f"{step_stem(step)}.json").write_text(json.dumps({"run_id": "c", "step": step}))
        (folder / f"{step_stem(step)}.safetensors").write_bytes(b"c's weights")
    if best:
        (folder / "checkpoint-best.json").write_text(json.dumps({"run_id": "c", "step": steps[-1]}))
    if records:
        (folder / "training_state.json").write_text(json.dumps({"schema_version": 3, "run_id": "c"}))
        (folder / "config.yaml").write_text("# resolved config of this run\nmodel: {}\n")
        (folder / "plan.json").write_text(json.dumps({"format": "apr-plan"}))
        (folder / ".apr").mkdir()
        (folder / ".apr" / "experiments.db").write_bytes(b"c's store")
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_resume_into_a_third_runs_folder_is_refused_before_its_records_are_written(tmp_path):
    """--allow-other-run lets run a resume beside run c's checkpoints, never over c's config.yaml,
    plan.json, training_state.json or store (one per folder): refused before anything is written."""
    from apr.train.outdir import refuse_resume_over_other_run

    folder = tmp_path / "c"
    before = _other_run_folder(folder, steps=(10, 20), best=False)
    with pytest.raises(AprError) as caught:
        refuse_resume_over_other_run(folder, tmp_path / "cfg.yaml", "a", start_step=2, total_steps=4, save_interval=2)
    err = caught.value
    assert err.findings[0].code == "resume.other_run_records" and err.findings[0].path == "training.output_dir"
    for name in ("config.yaml", "plan.json", "training_state.json", ".apr"):
        assert name in err.message
    assert "run c's records" in err.message and "run a" in err.message
    assert {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("steps, best, start, clash", [
    ((4,), False, 2, "checkpoint-step-4.json"),  # the last step: always saved
    ((6,), False, 2, "checkpoint-step-6.json"),  # on the save interval
    ((1,), True, 2, "checkpoint-best.json"),  # a run that evaluates saves a best
])
def test_a_resume_whose_saves_would_hit_another_runs_checkpoints_is_refused_up_front(tmp_path, steps, best, start,
                                                                                    clash):
    from apr.train.outdir import refuse_resume_over_other_run

    folder = tmp_path / "c"
    _other_run_folder(folder, steps=steps, best=best, records=False)
    with pytest.raises(AprError) as caught:
        refuse_resume_over_other_run(folder, tmp_path / "cfg.yaml", "a", start_step=start, total_steps=8,
                                     save_interval=2)
    assert caught.value.findings[0].code == "resume.other_run_clash"
    assert clash in caught.value.message


def test_a_resume_beside_another_runs_checkpoints_that_it_never_overwrites_goes_on(tmp_path):
    from apr.train.outdir import refuse_resume_over_other_run

    folder = tmp_path / "c"
    _other_run_folder(folder, steps=(1, 3, 40), best=True, records=False)  # odd steps, past the end; a best
    refuse_resume_over_other_run(folder, tmp_path / "cfg.yaml", "a", start_step=2, total_steps=8, save_interval=2,
                                 saves_best=False)
    # run a's own folder (its records are its own), and a folder of no other run, are never refused
    own = tmp_path / "a"
    _other_run_folder(own, steps=(2,), best=False)
    (own / "training_state.json").write_text('{"schema_version": 3, "run_id": "a"}')
    refuse_resume_over_other_run(own, tmp_path / "cfg.yaml", "a", start_step=4, total_steps=8, save_interval=2)
    refuse_resume_over_other_run(tmp_path / "empty", tmp_path / "cfg.yaml", "a", start_step=2, total_steps=8,
                                 save_interval=2)
