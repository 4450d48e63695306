"""`apr train fork` (apr/fork.py): a new run from a run's checkpoint, planned like any apply; with no
overrides it continues exactly as the parent did; it records its parent; it never touches an
existing folder and names the checkpoints there are."""

from __future__ import annotations

import hashlib
import json

import pytest
from safetensors.torch import load_file

from apr.apply import run_apply
from apr.errors import AprError
from apr.fork import run_fork
from apr.track.runs import show_run
from tests.train.run_helpers import make_dataset, write_config


@pytest.fixture
def parent(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 6, "save_interval": 2, "eval_interval": 0,
                                           "output_dir": "parent/"})
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None, handle_signals=False)
    assert result.status == "finished" and result.final_step == 6
    return tmp_path, result


def _weights(path):
    return load_file(str(path))


def test_a_fork_with_no_overrides_continues_bitwise_as_the_parent_and_records_it(parent):
    root, first = parent
    result = run_fork(root / "parent", at=2, apr_home=root / "home", echo=lambda line: None, handle_signals=False)
    out = root / "parent-fork-2"
    assert result.status == "finished" and (result.start_step, result.final_step) == (2, 6)
    assert result.run_dir == out and result.run_id != first.run_id
    forked, straight = _weights(out / "checkpoint-step-6.safetensors"), _weights(
        root / "parent" / "checkpoint-step-6.safetensors")
    assert forked.keys() == straight.keys()
    assert all((forked[k] == straight[k]).all() for k in straight)  # bitwise
    shown = show_run(result.run_id, apr_home=root / "home", global_=True)
    assert shown["parent"] == {"run_id": first.run_id, "step": 2}
    state = json.loads((out / "training_state.json").read_text())
    assert any(e["kind"] == "fork" and e["detail"]["parent"]["run_id"] == first.run_id for e in state["events"])


def test_a_fork_with_an_override_trains_its_own_course(parent):
    root, _ = parent
    result = run_fork(root / "parent", at=4, settings=["optimizer.lr=0.02"], out=root / "cooldown",
                      apr_home=root / "home", echo=lambda line: None, handle_signals=False)
    assert result.status == "finished" and result.start_step == 4
    forked = _weights(root / "cooldown" / "checkpoint-step-6.safetensors")
    straight = _weights(root / "parent" / "checkpoint-step-6.safetensors")
    assert any(not (forked[k] == straight[k]).all() for k in straight)


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def test_a_missing_step_is_refused_listing_the_checkpoints_there(parent):
    root, _ = parent
    with pytest.raises(AprError, match=r"no checkpoint at step 3; checkpoints there: 2, 4, 6"):
        run_fork(root / "parent", at=3, apr_home=root / "home", echo=lambda line: None)
    assert not (root / "parent-fork-3").exists()


def test_a_fork_into_an_existing_run_folder_is_refused_and_touches_nothing(parent):
    root, _ = parent
    before = _digest(root / "parent")
    for out in (root / "parent", root / "home"):
        with pytest.raises(AprError, match="fork"):
            run_fork(root / "parent", at=2, out=out, apr_home=root / "home", echo=lambda line: None)
    assert _digest(root / "parent") == before


def test_a_fork_the_plan_refuses_never_starts(parent):
    root, _ = parent
    with pytest.raises(AprError, match="the plan for"):
        run_fork(root / "parent", at=2, settings=["model.architecture.num_attention_heads=3"],
                 apr_home=root / "home", echo=lambda line: None)
    assert not (root / "parent-fork-2").exists()
