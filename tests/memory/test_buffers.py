"""apr/memory/buffers.py: each part of the composed engine declares its buffers, and the plan sums
what the engine ``build_engine`` composes declares (docs/design.md, "The buffer plan")."""

from __future__ import annotations

import pytest
import torch

from apr.memory.buffers import (
    autograd_buffers,
    buffer_plan,
    frozen_buffers,
    fsdp2_buffers,
    source_buffers,
    step_buffers,
)
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from tests.train.tiny import make_config

LORA = {"rank": 2, "alpha": 4.0, "targets": "all"}


@pytest.mark.parametrize("sections", [
    {"training": {"engine": "interleaved"}},
    {"training": {"engine": "standard"}},
    {"training": {"engine": "interleaved", "mixed_precision": "bf16"}},
    {"training": {"engine": "standard"}, "model": {"lora": LORA}},
    {"training": {"engine": "interleaved"}, "model": {"lora": LORA}},
])
def test_the_engine_build_composes_declares_what_the_plan_sums(sections):
    config = make_config(**sections)
    engine = build_engine(plan_of(config), "cpu")
    assert engine.declares is source_buffers(config)
    assert buffer_plan(config) == frozen_buffers(config) + engine.declares(config) + step_buffers(config)


def test_the_sharded_sources_declare_one_ranks_shards():
    for engine in ("standard", "interleaved"):
        config = make_config(training={"engine": engine, "sharding": "full", "world_size": 2})
        assert source_buffers(config) is fsdp2_buffers
        whole = {b.name: b.numel for b in source_buffers(make_config(training={"engine": engine}))(config.model_copy(
            update={"training": config.training.model_copy(update={"sharding": "none", "world_size": 1})}))}
        shards = {b.name: b.numel for b in fsdp2_buffers(config)}
        assert all(shards[n] == -(-whole[n] // 2) or shards[n] < whole[n] for n in whole if n.endswith(".adam_m"))


def test_autograd_declares_the_parameters_moments_and_gradients_torch_allocates():
    """The standard engine's parameters, torch AdamW's moments (after a step) and its gradients are
    the sizes ``autograd_buffers`` declares for them."""
    config = make_config(training={"engine": "standard"})
    engine = build_engine(plan_of(config), "cpu")
    batch = torch.randint(0, config.model.architecture.vocab_size, (config.data.batch_size, config.data.seq_len + 1))
    engine.train_step([batch], lr=1e-3)
    for p in engine.gradients.named.values():  # train_step leaves the gradients in place until the next step
        assert p.grad is not None
    held = engine.buffer_bytes()
    declared: dict[str, int] = {}
    for b in autograd_buffers(config):
        if b.name != "head_saved_grad":  # a temporary inside the loss, not held after the step
            declared[b.component] = declared.get(b.component, 0) + b.nbytes
    assert held == {"weights": declared["weights"], "gradients": declared["gradients"],
                    "adamw_m": declared["adamw_m"], "adamw_v": declared["adamw_v"]}


def test_a_lora_base_is_declared_by_the_transform_and_sharded_by_rows():
    """The frozen base is every parameter that gets no gradient; FSDP2 gives a rank ``ceil(rows /
    ranks)`` rows of each (tests/scenarios/test_composition.py checks that against real shards)."""
    config = make_config(model={"lora": LORA})
    frozen = [p for p in build_engine(plan_of(config), "cpu").model.parameters() if not p.requires_grad]
    declared = make_config(model={"lora": LORA, "init_from": "x"})
    assert sum(b.numel for b in frozen_buffers(declared)) == sum(p.numel() for p in frozen)
    two = make_config(model={"lora": LORA, "init_from": "x"}, training={"sharding": "full", "world_size": 2})
    assert sum(b.numel for b in frozen_buffers(two)) == sum(-(-p.shape[0] // 2) * p[0].numel() for p in frozen)
    assert not frozen_buffers(make_config())  # no LoRA, no frozen base
