"""A resume never writes over another run's folder (issue 39): a checkpoint of run A resumed into a
folder holding run B's checkpoints is refused unless explicitly allowed, pruning never deletes
another run's files, and files named like apr's records that apr did not write are never
overwritten (plan.json, training_state.json, config.yaml, the lock)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from apr.checkpoint.manager import CheckpointManager, OtherRunError, TrainState, folder_run_ids
from apr.errors import AprError
from apr.plan.build import resolve_config
from tests.checkpoint.conftest import make_tensors
from tests.checkpoint.test_sidecar import trainer_meta


def _save(folder: Path, config, run_id: str, steps, keep_last: int = 2, best: tuple = ()) -> CheckpointManager:
    mgr = CheckpointManager(folder, config, keep_last=keep_last, trainer_state=True)
    for step in steps:
        meta = {**trainer_meta(step), "run_id": run_id}
        mgr.save(TrainState(step=step, tensors=make_tensors(config, step), meta=meta), is_best=step in best)
    return mgr


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_resuming_another_runs_checkpoint_into_a_third_runs_folder_is_refused(tmp_path, tiny_config):
    _save(tmp_path / "a", tiny_config, "run-a", (4,))
    _save(tmp_path / "b", tiny_config, "run-b", (4, 8), best=(8,))
    before = _hashes(tmp_path / "b")
    mgr = CheckpointManager(tmp_path / "b", tiny_config, trainer_state=True)
    with pytest.raises(OtherRunError) as err:
        mgr.load(tmp_path / "a" / "checkpoint-step-4.json")
    message = err.value.message
    assert "run-b" in message and "run-a" in message and "another training.output_dir" in message
    assert err.value.findings[0].path == "training.output_dir"
    assert _hashes(tmp_path / "b") == before
    # the same checkpoint into an empty folder, or the folder's own run, is a plain resume
    CheckpointManager(tmp_path / "new", tiny_config, trainer_state=True).load(tmp_path / "a" / "checkpoint-step-4.json")
    CheckpointManager(tmp_path / "b", tiny_config, trainer_state=True).load("latest")
    allowed = CheckpointManager(tmp_path / "b", tiny_config, trainer_state=True)
    allowed.allow_other_run = True
    state, _ = allowed.load(tmp_path / "a" / "checkpoint-step-4.json")
    assert state.step == 4


def test_pruning_never_deletes_another_runs_checkpoints(tmp_path, tiny_config):
    folder = tmp_path / "shared"
    _save(folder, tiny_config, "run-b", (2, 6, 10), keep_last=3)
    theirs = {n: h for n, h in _hashes(folder).items() if n.startswith("checkpoint-step-")}
    assert len(theirs) == 6
    # run A, allowed into the folder, saves steps 4, 8, 12 with keep_last 1
    _save(folder, tiny_config, "run-a", (4, 8, 12), keep_last=1)
    after = _hashes(folder)
    assert {n: after.get(n) for n in theirs} == theirs  # every file of run B, byte for byte
    assert "checkpoint-step-12.json" in after and "checkpoint-step-4.json" not in after  # A pruned its own
    assert "checkpoint-step-8.json" not in after
    assert folder_run_ids(folder) == {"run-b": ["checkpoint-step-10.json", "checkpoint-step-6.json",
                                                "checkpoint-step-2.json"], "run-a": ["checkpoint-step-12.json"]}


def test_a_run_alone_in_its_folder_prunes_as_before(tmp_path, tiny_config):
    _save(tmp_path, tiny_config, "run-a", (2, 4, 6, 8), keep_last=2)
    names = sorted(p.name for p in tmp_path.glob("checkpoint-step-*.json"))
    assert names == ["checkpoint-step-6.json", "checkpoint-step-8.json"]


# ------------------------------------------------------------------ record files apr did not write


@pytest.mark.parametrize("name,content", [
    ("plan.json", '{"my": "plan"}\n'),
    ("training_state.json", '{"step": 3, "notes": "mine"}\n'),
    ("config.yaml", "model: mine\n"),
    (".apr-run.lock", "my lock notes\n"),
])
def test_user_files_named_like_records_stop_a_run_before_anything_is_written(tmp_path, name, content):
    """Fresh and resumed runs alike: refused, exit 1 by the CLI, the file unchanged."""
    from apr.train.outdir import OutputDirLock, refuse_user_records

    (tmp_path / name).write_text(content)
    with pytest.raises(AprError, match=name.replace(".", r"\.")):
        lock = OutputDirLock(tmp_path)
        lock.acquire(tmp_path / "cfg.yaml")
        try:
            refuse_user_records(tmp_path, tmp_path / "cfg.yaml")
        finally:
            lock.release()
    assert (tmp_path / name).read_text() == content


def test_records_apr_wrote_do_not_stop_a_run(tmp_path):
    from apr.plan.build import PLAN_FORMAT
    from apr.train.outdir import OutputDirLock, refuse_user_records

    (tmp_path / "plan.json").write_text(json.dumps({"format": PLAN_FORMAT, "format_version": "1"}))
    (tmp_path / "training_state.json").write_text(json.dumps({"schema_version": 3, "run_id": "r"}))
    (tmp_path / "config.yaml").write_text("# resolved config of this run (from x)\nmodel: {}\n")
    lock = OutputDirLock(tmp_path)
    lock.acquire(tmp_path / "cfg.yaml")
    lock.release()
    lock.acquire(tmp_path / "cfg.yaml")  # its own earlier record is fine
    lock.release()
    refuse_user_records(tmp_path, tmp_path / "cfg.yaml")


def test_apply_resume_from_another_run_into_a_third_runs_folder_is_refused_and_changes_nothing(tmp_path):
    """The trainer's own resume path: exit-1 error naming both runs, the third run's folder as it was."""
    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.run import ApplyOptions, prepare_run
    from tests.train.run_helpers import config_doc, make_dataset

    make_dataset(tmp_path, train_rows=32, val_rows=8)

    def run(out: str, resume=None, allow=False):
        cfg = AprConfig.model_validate(config_doc(tmp_path, training={
            "max_steps": 4, "save_interval": 2, "eval_interval": 0, "epochs": 1, "output_dir": out}))
        return prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                           options=ApplyOptions(resume=resume, echo=lambda line: None, allow_other_run=allow))

    run("a/").execute()
    run("b/").execute()
    before = {p: h for p, h in _hashes(tmp_path / "b").items() if p != ".apr-run.lock"}
    with pytest.raises(AprError, match="holds checkpoints of run"):
        run("b/", resume=str(tmp_path / "a" / "checkpoint-step-2.json")).execute()
    after = {p: h for p, h in _hashes(tmp_path / "b").items() if p != ".apr-run.lock"}
    assert after == before
    # --allow-other-run: run b's records (config.yaml, training_state.json, its store) are one per
    # folder: the resume is refused before any step is trained, and nothing of b's changes
    with pytest.raises(AprError, match="would write over them"):
        run("b/", resume=str(tmp_path / "a" / "checkpoint-step-2.json"), allow=True).execute()
    assert {p: h for p, h in _hashes(tmp_path / "b").items() if p != ".apr-run.lock"} == before
    # into a folder holding only another run's checkpoints whose step numbers do not collide, it
    # finishes beside that run's files
    run("c/").execute()
    for record in ("config.yaml", "plan.json", "training_state.json"):
        (tmp_path / "c" / record).unlink(missing_ok=True)
    shutil.rmtree(tmp_path / "c" / ".apr", ignore_errors=True)
    for p in (tmp_path / "c").glob("checkpoint-step-4*"):
        p.rename(p.with_name(p.name.replace("step-4", "step-40")))
    kept = {p: h for p, h in _hashes(tmp_path / "c").items() if "step-40" in p}
    (tmp_path / "c" / "checkpoint-best.json").unlink(missing_ok=True)
    result = run("c/", resume=str(tmp_path / "a" / "checkpoint-step-2.json"), allow=True).execute()
    assert result.status == "finished" and result.start_step == 2
    assert {p: h for p, h in _hashes(tmp_path / "c").items() if "step-40" in p} == kept
