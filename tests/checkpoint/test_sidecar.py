"""apr/checkpoint/sidecar.py: a hand-edited checkpoint JSON never reaches a resume or an export
(issue 24 item 19): the latest falls back past it with a warning naming what is wrong, a named one
is refused."""

from __future__ import annotations

import json

import pytest

from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState, read_checkpoint
from apr.checkpoint.rng import capture_rng
from tests.checkpoint.conftest import make_tensors


def trainer_meta(step: int) -> dict:
    return {
        "epoch": 0, "run_id": "r1", "tokens_seen": step * 16, "best_val_loss": float("inf"),
        "data": {"version": 1, "epoch": 0, "position": step, "seed": 0, "num_rows": 64, "batch_size": 2,
                 "world_size": 1, "gradient_accumulation": 1, "shuffle": True},
        "engine": {"engine": "interleaved", "optimizer_steps": step,
                   "loss_scaler": {"enabled": False, "scale": 1.0, "good_steps": 0, "skipped_steps": 0}},
        "rng": capture_rng(),
    }


@pytest.fixture
def run(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config, keep_last=2, trainer_state=True)
    for step in (4, 8):
        mgr.save(TrainState(step=step, tensors=make_tensors(tiny_config, step), meta=trainer_meta(step)))
    return tmp_path


def _edit(path, change):
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _deep(doc):
    node = doc["data"]
    for _ in range(100):
        node["x"] = {}
        node = node["x"]


@pytest.mark.parametrize("change, named", [
    (lambda d: d.pop("data"), "data: field required"),
    (lambda d: d.pop("rng"), "rng: field required"),
    (lambda d: d["engine"].update(optimizer_steps="8"), "engine.optimizer_steps"),
    (lambda d: d["data"].update(position=-1), "data.position"),
    (lambda d: d["rng"]["python"].update(state=[1, 2]), "rng.python.state"),
    (lambda d: d["rng"].update(torch_cpu="AAAA"), "rng.torch_cpu holds 3 bytes"),
    (lambda d: d.update(weights_size="big"), "weights_size"),
    (lambda d: d.update(weights_sha256=None), "weights_sha256"),
    (_deep, "nests more than 64 levels"),
    (lambda d: d["config"]["model"]["architecture"].update(rope_theta=1.0), "recorded config_hash"),
])
def test_latest_falls_back_past_an_edited_sidecar_naming_the_fault(run, tiny_config, change, named):
    _edit(run / "checkpoint-step-8.json", change)
    warnings = []
    mgr = CheckpointManager(run, tiny_config, on_warning=warnings.append, trainer_state=True)
    state, path = mgr.load("latest")
    assert state.step == 4 and path.name == "checkpoint-step-4.json"
    assert any(named in w and "checkpoint-step-8.json" in w for w in warnings), warnings
    with pytest.raises(CheckpointError, match="checkpoint-step-8.json") as err:
        mgr.load(run / "checkpoint-step-8.json")  # named explicitly: refused, not replaced
    assert named in err.value.message and err.value.reason in {"bad_meta", "edited", "unreadable"}


def test_a_sidecar_too_large_is_refused_before_it_is_parsed(run, tiny_config):
    path = run / "checkpoint-step-8.json"
    with open(path, "ab") as f:
        f.truncate(2 << 20)
    with pytest.raises(CheckpointError, match="not readable JSON") as err:
        read_checkpoint(path)
    assert err.value.reason == "unreadable"


def test_export_refuses_a_checkpoint_whose_architecture_was_edited(run, tmp_path):
    from apr.checkpoint.export import export_hf

    for step in (4, 8):
        _edit(run / f"checkpoint-step-{step}.json",
              lambda d: d["config"]["model"]["architecture"].update(rms_norm_eps=0.5))
    with pytest.raises(CheckpointError, match="recorded config_hash"):
        export_hf(run / "checkpoint-step-8.json", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_weights_only_readers_do_not_need_the_trainer_state(run):
    _edit(run / "checkpoint-step-8.json", lambda d: d.pop("rng"))
    assert read_checkpoint(run / "checkpoint-step-8.json", weights_only=True).step == 8


def test_nesting_too_deep_for_the_json_parser_is_an_error_not_a_traceback(run):
    path = run / "checkpoint-step-8.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match="nests more than") as err:
        read_checkpoint(path)
    assert err.value.reason == "unreadable"
