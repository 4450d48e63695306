"""The GPU-resident step: no host read inside a step; a non-finite loss or gradient flags the step on
the device, nothing is written from that step on, and ``check_finite`` reports it later."""

from __future__ import annotations

import pytest
import torch

from apr.plan.build import resolve_config
from apr.steps.resolved import resolve as plan_of
from apr.train import build as build_mod
from apr.train import walk as walk_mod
from apr.train.build import build_engine
from apr.train.engine import NonFiniteError
from tests.train.tiny import batches, make_config

# (activations, gradients, clip_mode): kept gradients, a norm-only pre-pass, one walk (per_block, adagc)
STRATEGIES = [("keep", "kept", "global"), ("recompute", "workspace", "global"),
              ("selective", "workspace", "per_block"), ("recompute", "workspace", "adagc")]


def _config(activations: str, gradients: str, clip: str, **training):
    return make_config(training={"execution": {"activations": activations, "gradients": gradients},
                                 "clip_mode": clip, **training})


def _state(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.train_state_tensors().items()}


class HostReads:
    """Counts the ways a tensor's value reaches Python: item, tolist, bool/float/int, numpy."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("activations,gradients,clip", STRATEGIES)
def test_a_step_reads_nothing_on_the_host_and_a_check_reads_once(monkeypatch, activations, gradients, clip):
    config = _config(activations, gradients, clip)
    engine = build_engine(plan_of(config))
    data = batches(config, 3)
    engine.train_step([data[0]], lr=1e-2)  # first-step allocations out of the way
    reads = HostReads(monkeypatch)
    for batch in data[1:]:
        engine.train_step([batch], lr=1e-2)
    assert reads.count == 0
    engine.check_finite()
    assert reads.count == 1
    engine.check_finite()  # no step since: nothing to read
    assert reads.count == 1


def test_fp16_keeps_its_one_loss_scale_read_per_step(monkeypatch):
    config = _config("keep", "kept", "global", mixed_precision="fp16")
    engine = build_engine(plan_of(config))
    data = batches(config, 2)
    engine.train_step([data[0]], lr=1e-2)
    reads = HostReads(monkeypatch)
    engine.train_step([data[1]], lr=1e-2)
    assert reads.count == 2  # the loss, then the global norm (overflow: skip and back off)


def _poison_loss_at(monkeypatch, calls: set[int]):
    """Make the head's loss sum NaN on the given ``train_step`` calls (gradients stay finite)."""
    real = walk_mod.linear_cross_entropy_fwd_bwd
    seen: dict = {"engine": None}

    def fwd_bwd(*args, **kwargs):
        loss, grad = real(*args, **kwargs)
        poisoned = seen["engine"] is not None and seen["engine"].calls in calls
        return (loss * float("nan") if poisoned else loss), grad

    monkeypatch.setattr(walk_mod, "linear_cross_entropy_fwd_bwd", fwd_bwd)
    return seen


@pytest.mark.parametrize("activations,gradients,clip", STRATEGIES)
def test_a_bad_step_and_every_step_after_it_write_nothing_until_checked(monkeypatch, activations, gradients, clip):
    config = _config(activations, gradients, clip)
    data = batches(config, 5)
    clean = build_engine(plan_of(config))
    for batch in data[:2]:
        clean.train_step([batch], lr=1e-2)

    engine = build_engine(plan_of(config))
    seen = _poison_loss_at(monkeypatch, {3})
    seen["engine"] = engine
    for batch in data:  # steps 3, 4 and 5 are not in the weights
        engine.train_step([batch], lr=1e-2)
    with pytest.raises(NonFiniteError) as err:
        engine.check_finite()
    assert (err.value.what, err.value.state_is_last_good, err.value.steps_back) == ("loss", True, 3)
    assert engine.optimizer_steps == 2
    after, want = _state(engine), _state(clean)
    for name, tensor in want.items():
        assert torch.equal(after[name], tensor), name
    if clip == "adagc":
        for name, ema in clean.adagc_ema.items():
            assert torch.equal(engine.adagc_ema[name], ema), name

    # checked and cleared: training goes on from the last good state exactly like the clean engine
    seen["engine"] = None
    engine.train_step([data[2]], lr=1e-2)
    clean.train_step([data[2]], lr=1e-2)
    engine.check_finite()
    for name, tensor in _state(clean).items():
        assert torch.equal(_state(engine)[name], tensor), name


@pytest.mark.parametrize("group,last_good", [("head", True), ("block.0", False)])
def test_a_bad_gradient_in_the_one_walk_says_whether_a_group_was_already_updated(group, last_good):
    """The single walk updates the head first and the embedding last: a NaN in the head's gradient
    stops every update; one in block 0 comes after the head and the later blocks were updated."""
    config = _config("recompute", "workspace", "per_block")
    engine = build_engine(plan_of(config))
    before = _state(engine)

    def poison(name: str) -> None:
        if name == group:
            target = engine.gradients.head if group == "head" else engine.gradients.block_groups[0]
            target.params[0].grad[0] = float("nan")

    engine.grad_probe = poison
    engine.train_step(batches(config, 1), lr=1e-2)
    with pytest.raises(NonFiniteError) as err:
        engine.check_finite()
    assert (err.value.what, err.value.state_is_last_good, err.value.steps_back) == ("gradients", last_good, 1)
    after = _state(engine)
    assert all(torch.equal(after[k], before[k]) for k in before) == last_good
    for name, tensor in after.items():  # nothing non-finite reached the state
        assert torch.isfinite(tensor).all(), name
    assert engine.optimizer_steps == 0


def test_the_standard_engine_still_stops_inside_the_step():
    config = make_config(training={"engine": "standard"})
    engine = build_engine(plan_of(config))
    with torch.no_grad():
        engine.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        engine.train_step(batches(config, 1), lr=1e-2)
    assert (err.value.what, err.value.steps_back) == ("loss", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("activations,gradients,clip", STRATEGIES)
def test_a_cuda_step_never_synchronises(activations, gradients, clip):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    config = _config(activations, gradients, clip, device="cuda", mixed_precision="bf16", kernels="auto")
    engine = build_engine(plan_of(config))
    data = [b.cuda() for b in batches(config, 3)]
    engine.train_step([data[0]], lr=1e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in data[1:]:
            engine.train_step([batch], lr=1e-2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine.check_finite()


def test_a_run_stops_at_the_next_log_with_the_last_good_weights(tmp_path, monkeypatch):
    """NaN loss at step 7 (log every 2 steps): the run notices at step 8, fails naming step 7 and
    checkpoints step 6 with the same weights as a clean run's step 6; the cursor is past step 7's
    batch, as when the error was raised inside the step."""
    import json

    from safetensors.torch import load_file

    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.run import ApplyOptions, prepare_run
    from tests.train.run_helpers import config_doc, make_dataset

    make_dataset(tmp_path)

    def run(out: str):
        cfg = AprConfig.model_validate(config_doc(tmp_path, training={
            "output_dir": out, "save_interval": 2, "eval_interval": 0, "log_interval": 2}))
        opts = ApplyOptions(echo=lambda line: None)
        r = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                        options=opts)
        return r, r.execute()

    _, clean = run("clean/")
    assert clean.status == "finished"
    seen = _poison_loss_at(monkeypatch, {7})
    real_build = build_mod.build_engine

    def build(*a, **k):
        seen["engine"] = real_build(*a, **k)
        return seen["engine"]

    monkeypatch.setattr(build_mod, "build_engine", build)
    bad_run, bad = run("bad/")
    assert (bad.status, bad.exit_code, bad.final_step) == ("failed", 1, 6)
    assert "non-finite loss at step 7" in str(bad.reason)
    assert bad_run.engine.optimizer_steps == 6
    want = load_file(str(tmp_path / "clean" / "checkpoint-step-6.safetensors"))
    got = load_file(str(tmp_path / "bad" / "checkpoint-step-6.safetensors"))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    meta = json.loads((tmp_path / "bad" / "checkpoint-step-6.json").read_text())
    assert meta["data"]["position"] == 7, meta["data"]
