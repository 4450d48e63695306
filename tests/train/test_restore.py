"""The restore service (apr/train/restore.py): a rollback (a checkpoint of this run read back), an
orchestrator branch's rewind (a snapshot in memory) and a resume (a new run from the checkpoint)
put back the same fields, so the steps after each are bitwise those of the run that never left;
the parts a caller keeps stay as they are; a restore across a stacking boundary rebuilds the engine
at the state's depth."""

from __future__ import annotations

import pytest
import torch

from apr.checkpoint.rng import capture_rng, restore_rng
from apr.track.names import new_run_id
from apr.train.restore import Saved, Snapshot, restore
from apr.train.stacking import grow
from tests.train.run_helpers import make_dataset
from tests.train.test_checkpoints import ES, Rec, _assert_equal, _prepare, _tensors


@pytest.fixture(autouse=True)
def _rngs_put_back():
    """A run seeds the process's RNGs and a restore sets them: put back as they were."""
    saved = capture_rng()
    yield
    restore_rng(saved)


@pytest.fixture
def prepared(tmp_path):
    make_dataset(tmp_path)
    runs = []

    def make(**kw):
        run = _prepare(tmp_path, **kw)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.lock.release()


def _next_steps(run, n: int = 2) -> dict:
    """``n`` steps of the loop from where the run stands, and everything they leave behind."""
    losses = [float(x) for x in run.run_steps(n)]
    return {"losses": losses, "step": run.step, "optimizer_steps": run.engine.optimizer_steps,
            "cursor": run.loader.state_dict(), "meta": run.registry.state_dict(), "tensors": _tensors(run),
            "draw": torch.rand(4)}


def _assert_same(got: dict, want: dict) -> None:
    _assert_equal(got.pop("tensors"), want["tensors"])  # weights and AdamW moments, bitwise
    assert got.pop("draw").equal(want["draw"])  # the RNG stream
    assert got == {k: v for k, v in want.items() if k not in ("tensors", "draw")}


def _move_on(run) -> None:
    """What a run changes after the state it will go back to: parts a restore must put back."""
    run.validation.best = 1.0
    run.early_stopping.observe(run.step, 1.0)
    torch.rand(9)


def test_a_rollback_a_branch_rewind_and_a_resume_continue_bitwise_as_the_run_that_never_left(prepared):
    first = prepared(training=ES)
    first.run_id = new_run_id()
    first.run_steps(3)
    first.validation.first, first.validation.best = 4.0, 3.5
    first.early_stopping.observe(3, 3.5)
    torch.rand(7)  # the RNG stream moved on since the run's seeding
    snapshot = Snapshot.take(first)  # an orchestrator's decision point
    path = first.save(3, False, Rec())
    first.record_checkpoints(Rec(), wait=True)
    want = _next_steps(first)  # steps 4-5 of the run that never left step 3
    assert want["step"] == 5 and want["optimizer_steps"] == 5
    _move_on(first)

    assert restore(first, Saved(*first.load_checkpoint(path))) == 3  # training.rollback's restore
    assert first.step == 3
    rolled_back = _next_steps(first)
    _move_on(first)
    restore(first, snapshot)  # the orchestrator's: a branch's start, the winner's state, safety
    branch = _next_steps(first)
    first.lock.release()
    resumed = prepared(resume="latest", training=ES)  # --resume latest
    assert resumed.start_step == resumed.step == 3
    for got in (rolled_back, branch, _next_steps(resumed)):
        _assert_same(got, want)


def test_the_parts_a_restore_keeps_stay_as_they_are(prepared):
    """The orchestrator's safety rollback keeps the data cursor past the bad window: the weights go
    back, the cursor does not, so the next steps read the data after it."""
    run = prepared()
    run.run_steps(2)
    snapshot = Snapshot.take(run)
    want = _next_steps(run)
    cursor = run.loader.state_dict()
    restore(run, snapshot, keep=("data",))
    assert run.step == 2 and run.engine.optimizer_steps == 2 and run.loader.state_dict() == cursor
    _assert_equal(_tensors(run), snapshot.tensors)
    assert [float(x) for x in run.run_steps(2)] != want["losses"]  # other rows, from the same weights
    with pytest.raises(ValueError, match="no stateful part named \\['cursor'\\]"):
        restore(run, snapshot, keep=("cursor",))


def test_a_restore_rebuilds_the_engine_at_the_states_stacking_stage(prepared, tmp_path):
    stacking = {"stages": [{"blocks": 2, "steps": 4}, {"blocks": 4}], "init": "copy_top"}
    run = prepared(model={"architecture": {"num_hidden_layers": 4}, "stacking": stacking})
    rec = Rec()
    run.run_steps(4)
    run.save(4, False, rec)
    grow(run, 5, rec)  # step 5 starts stage 1: 4 blocks
    run.run_steps(1)
    grown = _tensors(run)
    run.save(5, False, rec)
    run.record_checkpoints(rec, wait=True)
    assert rec.events == [("stack", 5)]

    restore(run, Saved(*run.load_checkpoint(tmp_path / "run" / "checkpoint-step-4.json")))  # before the growth
    assert len(run.engine.model.model.layers) == 2 and run.stack_stage == 0 and run.step == 4
    assert not any(".layers.2." in name for name in _tensors(run))
    restore(run, Saved(*run.load_checkpoint(tmp_path / "run" / "checkpoint-step-5.json")))
    assert len(run.engine.model.model.layers) == 4 and run.stack_stage == 1 and run.step == 5
    _assert_equal(_tensors(run), grown)
