"""The compute copy (issue 14): under bf16/fp16 the interleaved engine keeps each block's weights in
the compute dtype, written by AdamW's param_copy, so no forward or recompute re-casts the fp32
masters; the numbers are those of autocast's casts, bitwise."""

from __future__ import annotations

import pytest
import torch
from tiny import batches, make_config
from torch.utils._python_dispatch import TorchDispatchMode

from apr.memory import buffers
from apr.model import spec
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine

POLICIES = [  # (activations, gradients, clip_mode): every walk the engine has
    ("keep", "kept", "global"), ("recompute", "workspace", "global"), ("selective", "workspace", "per_block"),
    ("recompute", "workspace", "adagc"),
]


def _config(precision: str, activations: str, gradients: str, clip: str, **training):
    return make_config(training={"mixed_precision": precision, "clip_mode": clip,
                                 "execution": {"activations": activations, "gradients": gradients}, **training})


def _train(config, steps: int = 4, copy: bool = True, monkeypatch=None):
    if not copy:
        monkeypatch.setattr(buffers, "uses_compute_copy", lambda *a, **k: False)
    engine = build_engine(plan_of(config))
    for b in batches(config, steps, seed=4):
        engine.train_step([b], lr=1e-2)
    if not copy:
        monkeypatch.undo()
    return engine


@pytest.mark.parametrize("activations, gradients, clip", POLICIES)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_compute_copy_trains_bitwise_like_autocasts_casts(precision, activations, gradients, clip, monkeypatch):
    config = _config(precision, activations, gradients, clip)
    with_copy = _train(config)
    assert all(g.compute is not None for g in with_copy.gradients.block_groups)
    without = _train(config, copy=False, monkeypatch=monkeypatch)
    assert all(g.compute is None for g in without.gradients.block_groups)
    a, b = with_copy.train_state_tensors(), without.train_state_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_copy_is_the_masters_rounded_after_every_update():
    config = _config("bf16", "recompute", "workspace", "global")
    engine = _train(config, steps=3)
    for g in engine.gradients.block_groups:
        assert g.compute.dtype == torch.bfloat16
        assert torch.equal(g.compute, g.flat_params.to(torch.bfloat16))


class _Casts(TorchDispatchMode):
    """Counts float32 -> low-precision copies of 2-D tensors (a matmul weight being cast)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and args:
            x = args[0]
            if x.dtype == torch.float32 and tuple(x.shape) in self.shapes and kwargs.get(
                    "dtype", args[1] if len(args) > 1 else None) in (torch.bfloat16, torch.float16):
                self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("activations", ["keep", "recompute"])
def test_no_forward_casts_the_block_weights(activations, monkeypatch):
    config = _config("bf16", activations, "kept" if activations == "keep" else "workspace", "per_block")
    arch = config.model.architecture
    shapes = {tuple(s.shape) for s in spec.block_param_specs(arch, 0) if len(s.shape) == 2}
    data = batches(config, 2, seed=1)
    counts = {}
    for copy in (True, False):
        if not copy:
            monkeypatch.setattr(buffers, "uses_compute_copy", lambda *a, **k: False)
        engine = build_engine(plan_of(config))
        engine.train_step([data[0]], lr=1e-2)
        with _Casts(shapes) as casts:
            engine.train_step([data[1]], lr=1e-2)
        counts[copy] = casts.count
    assert counts[False] >= len(shapes) * arch.num_hidden_layers  # autocast casts every block's weights
    assert counts[True] == 0


def test_a_resumed_run_derives_its_copy_from_the_loaded_masters():
    config = _config("bf16", "recompute", "workspace", "global")
    data = batches(config, 6, seed=9)
    straight = build_engine(plan_of(config))
    for b in data:
        straight.train_step([b], lr=1e-2)
    first = build_engine(plan_of(config))
    for b in data[:3]:
        first.train_step([b], lr=1e-2)
    resumed = build_engine(plan_of(config), seed=1234)
    resumed.load_train_state_tensors({k: v.clone() for k, v in first.train_state_tensors().items()})
    resumed.load_meta_state(first.meta_state())
    for b in data[3:]:
        resumed.train_step([b], lr=1e-2)
    a, b = straight.train_state_tensors(), resumed.train_state_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_plan_counts_the_copy_and_the_engine_allocates_exactly_that():
    config = _config("bf16", "recompute", "workspace", "global")
    rows = [b for b in buffers.buffer_plan(config) if b.component == "compute_weights"]
    arch = config.model.architecture
    assert len(rows) == arch.num_hidden_layers and all(r.dtype == "bfloat16" for r in rows)
    engine = build_engine(plan_of(config))
    assert sum(g.compute.numel() * g.compute.element_size() for g in engine.gradients.block_groups) == sum(
        r.nbytes for r in rows)
    for fp32 in (_config("fp32", "recompute", "workspace", "global"),
                 _config("bf16", "recompute", "workspace", "global", engine="standard")):
        assert not [b for b in buffers.buffer_plan(fp32) if b.component == "compute_weights"]
