"""The flat-buffer walk with model dropout (``model.architecture.dropout``): a recomputed block
replays its forward's RNG state, so the walk trains as autograd does and resumes bitwise; the same
with multi-head latent attention (``model.architecture.attention: {kind: mla}``) in the blocks."""

from __future__ import annotations

import pytest
import torch

from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from tests.train.tiny import batches, make_config

MLA = {"num_key_value_heads": None, "attention": {"kind": "mla", "kv_lora_rank": 6, "qk_rope_head_dim": 4,
                                                  "q_lora_rank": 8}}


@pytest.mark.parametrize(("activations", "attention"), [
    pytest.param("recompute", {}, id="recompute"), pytest.param("selective", {}, id="selective"),
    pytest.param("keep", {}, id="keep"), pytest.param("selective", MLA, id="selective-mla"),
    pytest.param("keep", MLA, id="keep-mla")])
def test_the_walk_with_dropout_trains_as_autograd(activations, attention):
    data = batches(make_config(), 3, seed=4)
    arch = {"architecture": {"dropout": 0.2, **attention}}
    weights, norms = {}, {}
    for name, training in (("walk", {"engine": "interleaved", "execution": {"activations": activations}}),
                           ("autograd", {"engine": "standard"})):
        engine = build_engine(plan_of(make_config(model=arch, training=training)))
        torch.manual_seed(0)  # dropout draws from the global RNG
        norms[name] = [float(engine.train_step([b], lr=1e-2).grad_norm) for b in data]
        weights[name] = {k: v.clone() for k, v in engine.train_state_tensors().items()}
    assert norms["walk"] == pytest.approx(norms["autograd"], rel=1e-6)
    for k, v in weights["autograd"].items():
        torch.testing.assert_close(weights["walk"][k], v, atol=1e-7, rtol=1e-6)
    torch.manual_seed(0)  # without dropout the same steps end elsewhere: the masks were drawn
    plain = build_engine(plan_of(make_config(model={"architecture": attention}, training={"engine": "standard"})))
    for b in data:
        plain.train_step([b], lr=1e-2)
    assert any(not torch.equal(v, weights["autograd"][k]) for k, v in plain.train_state_tensors().items())


@pytest.mark.parametrize(("engine", "attention"), [
    pytest.param("interleaved", {}, id="interleaved"), pytest.param("standard", {}, id="standard"),
    pytest.param("interleaved", MLA, id="interleaved-mla")])
def test_a_run_with_dropout_resumed_from_a_middle_checkpoint_ends_bitwise_equal(engine, attention, tmp_path):

    from run_helpers import make_dataset, resume_elsewhere, write_config

    from apr.apply import run_apply

    make_dataset(tmp_path, train_rows=48, val_rows=8)
    sections = {"model": {"architecture": {"dropout": 0.2, **attention}},
                "training": {"engine": engine, "execution": {"activations": "recompute"}, "max_steps": 4,
                             "save_interval": 2, "eval_interval": 2}}
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    straight = run_apply(write_config(tmp_path, **sections), **quiet)
    assert straight.final_step == 4
    resume_elsewhere(tmp_path, sections, straight, 2, 4, quiet)
