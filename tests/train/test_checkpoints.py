"""The run's checkpoints (apr/train/checkpoints.py): a save holds the engine's weights and AdamW
moments and every registered part of the run's state; a resume restores all of it and continues
bitwise as if never stopped (the restore itself: tests/train/test_restore.py); resume refuses a
checkpoint past the run's end, another model, and a breaking change, naming the overrides the
checkpoint's run was started with; a failed background write is a warning once the run's end is
decided."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from apr.checkpoint.rng import capture_rng, restore_rng
from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.build import resolve_config
from apr.track.names import new_run_id
from apr.train.run import ApplyOptions, prepare_run
from tests.train.run_helpers import config_doc, make_dataset


class Rec:
    """The recorder calls a checkpoint makes: which checkpoints were recorded, and events."""

    def __init__(self):
        self.checkpoints: list[tuple[int, str, bool]] = []
        self.events: list[tuple[str, int]] = []

    def checkpoint(self, step, path, is_best=False):
        self.checkpoints.append((step, Path(path).name, is_best))

    def flush(self, timeout=None):
        pass

    def log_event(self, kind, step, message, detail=None):
        self.events.append((kind, step))


@pytest.fixture(autouse=True)
def _rngs_put_back():
    """A run seeds the process's RNGs and a resume restores them: put back as they were."""
    saved = capture_rng()
    yield
    restore_rng(saved)


@pytest.fixture
def root(tmp_path, request):
    make_dataset(tmp_path, train_rows=getattr(request, "param", 96))
    return tmp_path


def _prepare(root: Path, *, resume=None, force=False, overrides=None, lines=None, **sections):
    cfg = AprConfig.model_validate(config_doc(root, **sections))
    opts = ApplyOptions(resume=resume, force=force, overrides=overrides or {}, handle_signals=False,
                        echo=(lines if lines is not None else []).append)
    return prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml", options=opts)


@pytest.fixture
def prepared(root):
    """prepare_run, the output folder's lock released at the end (the loop, never run here, would)."""
    runs = []

    def make(**kw):
        run = _prepare(root, **kw)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.lock.release()


def _train(run, steps: int) -> list[float]:
    """Optimizer steps as the run loop takes them: the schedule's LR, accumulation's micro-batches."""
    losses = []
    for _ in range(steps):
        run.step += 1
        micro = [run.loader.next_batch() for _ in range(run.config.training.gradient_accumulation)]
        losses.append(float(run.engine.train_step(micro, run.schedule(run.step)).loss))
    return losses


def _tensors(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.engine.train_state_tensors().items()}


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].equal(tensor), name


ES = {"early_stopping": {"patience": 3}}


def test_a_save_holds_the_weights_moments_and_every_registered_part(prepared):
    run = prepared(training={"checkpoint_async": False, **ES})
    run.run_id = new_run_id()
    _train(run, 3)
    run.validation.first, run.validation.best = 4.0, 3.5
    run.early_stopping.observe(0, 4.0)
    run.early_stopping.observe(2, 4.0)
    rec = Rec()
    path = run.checkpoints.save(3, True, rec)
    assert path.name == "checkpoint-step-3.json" and run.checkpoints.last == path
    assert rec.checkpoints == [(3, "checkpoint-step-3.json", True)]  # written before save returns

    _assert_equal(load_file(str(path.with_suffix(".safetensors"))), _tensors(run))
    assert any(name.startswith("optimizer.m.") for name in _tensors(run))  # AdamW's moments travel too
    meta = json.loads(path.read_text())
    assert meta["step"] == 3 and meta["is_best"] is True
    assert meta["run_id"] == run.run_id and meta["cli_overrides"] == {}
    assert meta["data"] == run.loader.state_dict() and meta["data"]["position"] == 3
    assert meta["engine"]["optimizer_steps"] == 3
    assert meta["schedule"] == {"step": 3, "total_steps": 12, "lr_next": pytest.approx(run.schedule(4))}
    assert (meta["best_val_loss"], meta["first_val_loss"]) == (3.5, 4.0)
    assert meta["early_stopping"] == {"best": 4.0, "best_step": 0, "waited": 1}
    assert meta["tokens_seen"] == 3 * 64  # 3 steps x 4 rows x 16 tokens
    assert (path.parent / "checkpoint-best.json").is_file()


def test_background_writes_are_recorded_once_each_when_written(prepared):
    run = prepared(training={"checkpoint_async": True})
    rec = Rec()
    _train(run, 1)
    path = run.checkpoints.save(1, True, rec)  # returns before the files need exist
    assert path.name == "checkpoint-step-1.json" and run.checkpoints.last == path
    _train(run, 1)
    run.checkpoints.save(2, False, rec)  # waits for step 1's write, then records what was written
    assert rec.checkpoints[0] == (1, "checkpoint-step-1.json", True)
    run.checkpoints.record(rec, wait=True)
    run.checkpoints.record(rec, wait=True)
    assert rec.checkpoints == [(1, "checkpoint-step-1.json", True), (2, "checkpoint-step-2.json", False)]
    _assert_equal(load_file(str(path.parent / "checkpoint-step-2.safetensors")), _tensors(run))


def test_the_last_steps_checkpoint_has_no_next_lr(prepared):
    run = prepared(training={"max_steps": 2})
    _train(run, 2)
    path = run.checkpoints.save(2, False, Rec())
    run.checkpoints.record(Rec(), wait=True)
    assert json.loads(path.read_text())["schedule"] == {"step": 2, "total_steps": 2, "lr_next": None}


def test_a_resume_restores_everything_and_continues_bitwise(prepared, root):
    first = prepared(training=ES)
    first.run_id = new_run_id()
    _train(first, 3)
    first.validation.first, first.validation.best = 4.0, 3.5
    first.early_stopping.observe(2, 3.5)
    torch.rand(7)  # the run's RNG stream moved on since its seeding (nothing here draws from it)
    saved, cursor = _tensors(first), first.loader.state_dict()
    first.checkpoints.save(3, False, Rec())
    first.checkpoints.record(Rec(), wait=True)
    drawn = torch.rand(5)  # the RNG stream right after the save
    after = _train(first, 2)
    first.lock.release()

    lines: list[str] = []
    resumed = prepared(resume="latest", lines=lines, training=ES)
    json_path = root / "run" / "checkpoint-step-3.json"
    assert resumed.start_step == 3 and resumed.run_id == first.run_id
    assert resumed.resumed_from == json_path == resumed.checkpoints.last
    assert resumed.engine.optimizer_steps == 3
    _assert_equal(_tensors(resumed), saved)
    assert resumed.loader.state_dict() == cursor
    assert (resumed.validation.first, resumed.validation.best) == (4.0, 3.5)
    assert resumed.early_stopping.state_dict() == first.early_stopping.state_dict()
    assert torch.rand(5).equal(drawn)
    assert f"resumed from {json_path} (step 3, epoch 0)" in lines
    resumed.step = resumed.start_step
    assert _train(resumed, 2) == after
    _assert_equal(_tensors(resumed), _tensors(first))


def _saved_at(prepared, step: int, **kw):
    run = prepared(**kw)
    _train(run, step)
    run.checkpoints.save(step, False, Rec())
    run.checkpoints.record(Rec(), wait=True)
    run.lock.release()
    return run


@pytest.mark.parametrize("root", [24], indirect=True)  # 24 rows / 4 = 6 steps per epoch
@pytest.mark.parametrize(("training", "key", "total"), [
    ({"max_steps": 6}, "training.max_steps", 6),  # max_steps 6 of the 12 two epochs give
    ({"max_steps": 100, "epochs": 1}, "training.epochs", 6),  # the data caps the steps, not max_steps
])
def test_a_checkpoint_past_the_runs_end_is_refused_naming_the_key_to_raise(prepared, training, key, total):
    _saved_at(prepared, 8, training={"max_steps": 12, "epochs": 2})
    with pytest.raises(AprError, match=f"is at step 8, past the {total} steps this config runs; raise {key}") as err:
        prepared(resume="latest", training=training)
    finding = err.value.findings[0]
    assert (finding.code, finding.path, finding.expected, finding.got) == (
        "resume.past_the_end", key, ">= 8 steps", f"{total} steps")


def test_a_breaking_change_names_the_overrides_the_checkpoint_was_started_with(prepared):
    started = {"seed": 5, "optimizer.lr": 0.005}
    _saved_at(prepared, 2, overrides=started, training={"seed": 5}, optimizer={"lr": 0.005})
    with pytest.raises(AprError, match="break an exact resume") as err:
        prepared(resume="latest")
    assert err.value.message.endswith("(the checkpoint's run was started with --seed 5 optimizer.lr=0.005; pass "
                                      "them again to resume it)")
    assert {f.path for f in err.value.findings} >= {"training.seed", "optimizer.lr"}
    run = prepared(resume="latest", overrides=started, training={"seed": 5}, optimizer={"lr": 0.005})
    assert run.start_step == 2


def test_a_checkpoint_of_another_model_is_refused_with_the_config_diff(prepared):
    _saved_at(prepared, 2)
    with pytest.raises(AprError, match="is a checkpoint of another model: the config changed in a way a resume "
                                       "cannot take, even with --force") as err:
        prepared(resume="latest", force=True, model={"architecture": {"intermediate_size": 96}})
    assert [f.path for f in err.value.findings] == ["model.architecture.intermediate_size"]


def test_settle_makes_a_failed_background_write_a_warning(prepared, monkeypatch):
    lines: list[str] = []
    run = prepared(lines=lines)

    def failed_write():
        raise OSError("No space left on device")

    monkeypatch.setattr(run.checkpoints.manager, "wait", failed_write)
    with pytest.raises(OSError):  # where the run goes on, the failure is the run's
        run.checkpoints.record(Rec(), wait=True)
    run.checkpoints.settle(Rec())  # a crash or a second signal: the end is decided already
    assert lines[-1] == "warning: a background checkpoint write failed: OSError: No space left on device"
