"""One memory model (docs/design.md, "The composed engine"): the plan's buffer rows for weights,
adapters, AdamW moments and gradients are what the composed engine really holds after a step, for
the compositions whose buffers torch allocates (autograd, with and without LoRA) as for the walk
(which allocates from the plan by name)."""

from __future__ import annotations

import pytest
import torch

from apr.memory.buffers import buffer_plan
from apr.steps.execution import from_config
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from tests.train.tiny import batches, make_config

LORA = {"rank": 3, "alpha": 6.0, "targets": "all"}
MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 24}
TIME = {"embedding_dim": 8, "num_time_steps": 20, "encoding": "learned"}
MLA = {"num_key_value_heads": None, "attention": {"kind": "mla", "kv_lora_rank": 6, "qk_rope_head_dim": 4,
                                                  "q_lora_rank": 8}}


def _planned(config) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in buffer_plan(config, from_config(config)):
        if b.component in ("weights", "adapters", "adamw_m", "adamw_v") or b.name.endswith(".grad"):
            key = "gradients" if b.name.endswith(".grad") else b.component
            out[key] = out.get(key, 0) + b.nbytes
    return out


@pytest.mark.parametrize("sections", [
    {"training": {"engine": "standard"}},
    {"training": {"engine": "standard", "gradient_accumulation": 2}},
    {"training": {"engine": "standard"}, "model": {"init_from": None, "lora": LORA}},
    {"training": {"engine": "interleaved", "execution": {"activations": "keep", "gradients": "kept"}}},
    {"training": {"engine": "interleaved"}, "model": {"init_from": None, "lora": LORA}},
    {"training": {"engine": "standard"}, "model": {"architecture": {"moe": MOE}}},
    {"training": {"engine": "standard"}, "model": {"architecture": MLA}},
    {"training": {"engine": "standard"}, "model": {"architecture": {"time": TIME}}},
], ids=["autograd", "autograd-accumulation", "autograd-lora", "walk-kept", "walk-lora", "autograd-moe", "autograd-mla",
        "autograd-time"])
def test_the_plans_rows_are_what_the_engine_holds(sections):
    config = make_config(**sections)
    engine = build_engine(plan_of(config, execution=from_config(config)))
    engine.train_step(batches(config, config.training.gradient_accumulation), 1e-3)
    held = engine.buffer_bytes()
    if engine.source == "interleaved":  # by buffer name: map each to its plan row
        rows = {b.name: b for b in buffer_plan(config, from_config(config))}
        by: dict[str, int] = {}
        for name, nbytes in held.items():
            key = "gradients" if name.endswith(".grad") else rows[name].component
            if key in ("weights", "adapters", "adamw_m", "adamw_v", "gradients") and \
                    (key != "gradients" or name.endswith(".grad")):
                by[key] = by.get(key, 0) + nbytes
        held = by
    elif config.model.lora is not None:  # torch's parameters are the adapters
        held = {("adapters" if k == "weights" else k): v for k, v in held.items()}
    planned = _planned(config)
    assert {k: v for k, v in held.items() if v} == planned


def test_the_plans_parameters_and_flops_of_experts_are_what_the_model_holds_and_runs():
    """model.architecture.moe: the plan's parameter count is the model's; its active count is the
    model's less the expert weights one token's gradient does not reach; its FLOPs per token exceed the
    dense model's by 3x the forward matmul FLOPs torch counts beyond the dense model's."""
    from torch.utils.flop_counter import FlopCounterMode

    from apr.plan.configfacts import model_facts

    moe = make_config(training={"engine": "standard"}, model={"architecture": {"moe": MOE}})
    dense = make_config(training={"engine": "standard"})
    facts, engine = model_facts(moe), build_engine(plan_of(moe, execution=from_config(moe)))
    model = engine.model
    assert facts["params"] == sum(p.numel() for p in model.parameters())
    model(batches(moe, 1)[0][:1, :1]).sum().backward()  # one token: the expert rows its gradient reaches
    experts = {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}
    reached = sum(int((p.grad != 0).sum()) for p in experts.values())
    assert facts["moe"]["active_params"] == facts["params"] - sum(p.numel() for p in experts.values()) + reached

    tokens = moe.data.batch_size * moe.data.seq_len
    flops = {}
    for name, config in (("moe", moe), ("dense", dense)):
        lm = build_engine(plan_of(config, execution=from_config(config))).model
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            lm(batches(config, 1)[0][:, :-1])
        flops[name] = counter.get_total_flops()
    assert model_facts(moe)["flops_per_token"] - model_facts(dense)["flops_per_token"] == \
        3 * (flops["moe"] - flops["dense"]) // tokens


def test_the_plans_parameters_and_flops_of_the_time_embedding_are_what_the_model_holds_and_runs():
    """model.architecture.time: the plan's parameter count is the model's (the table and the projection
    with the embedding); its FLOPs per token exceed the plain model's by 3x the forward FLOPs torch
    counts for the projection, which runs once per sequence."""
    from torch.utils.flop_counter import FlopCounterMode

    from apr.plan.configfacts import model_facts

    timed = make_config(training={"engine": "standard"}, model={"architecture": {"time": TIME}})
    plain = make_config(training={"engine": "standard"})
    model = build_engine(plan_of(timed, execution=from_config(timed))).model
    assert model_facts(timed)["params"] == sum(p.numel() for p in model.parameters()) == \
        model_facts(plain)["params"] + 20 * 8 + 8 * 32
    tokens = timed.data.batch_size * timed.data.seq_len
    flops = {}
    for name, config in (("timed", timed), ("plain", plain)):
        lm = build_engine(plan_of(config, execution=from_config(config))).model
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            lm(batches(config, 1)[0][:, :-1])
        flops[name] = counter.get_total_flops()
    assert flops["timed"] > flops["plain"]
    assert model_facts(timed)["flops_per_token"] - model_facts(plain)["flops_per_token"] == \
        3 * (flops["timed"] - flops["plain"]) // tokens
