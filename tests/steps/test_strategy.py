"""apr/steps/strategy.py: which gradients a step keeps, whether a norm pre-pass runs, and the buffer
plan (apr/model/spec.py) that allocates accordingly."""

from __future__ import annotations

import copy

import pytest

from apr.config.schema import AprConfig
from apr.memory.buffers import buffer_plan
from apr.steps.strategy import step_strategy

BASE = {
    "model": {"architecture": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "intermediate_size": 64, "vocab_size": 50, "max_position_embeddings": 16}},
    "data": {"train": "d/", "batch_size": 2, "seq_len": 8},
    "training": {"mixed_precision": "fp32"},
}


def config(execution=None, **training) -> AprConfig:
    doc = copy.deepcopy(BASE)
    doc["training"].update(training)
    if execution is not None:
        doc["training"]["execution"] = {"activations": "recompute", "gradients": execution}
    return AprConfig.model_validate(doc)


@pytest.mark.parametrize("cfg,keeps,prepass,walks,says", [
    (config(engine="standard"), True, False, 1, "standard engine"),
    (config("workspace", clip_mode="global"), False, True, 2, "pre-pass for the global norm"),
    (config("workspace", clip_mode="per_block"), False, False, 1, "AdamW per block right after its backward"),
    (config("workspace", grad_clip=None), False, False, 1, "no clipping"),
    (config("workspace", grad_clip=None, mixed_precision="fp16"), False, True, 2, "fp16 overflow check"),
    (config("kept", clip_mode="global"), True, False, 1, "every gradient kept"),
    (config(gradient_accumulation=2, clip_mode="global"), True, False, 1, "every gradient kept"),
])
def test_strategy_of_a_config(cfg, keeps, prepass, walks, says):
    st = step_strategy(cfg)
    assert (st.keeps_all_grads, st.norm_prepass, st.backward_walks) == (keeps, prepass, walks)
    assert says in st.describe()


def test_loss_scaling_only_in_fp16():
    assert step_strategy(config("workspace", mixed_precision="fp16")).loss_scaling
    assert not step_strategy(config("workspace", mixed_precision="bf16")).loss_scaling


@pytest.mark.parametrize("cfg", [config("workspace"), config("kept"), config(engine="standard"),
                                 config(gradient_accumulation=3)])
def test_the_buffer_plan_allocates_the_gradients_the_strategy_keeps(cfg):
    names = {b.name for b in buffer_plan(cfg)}
    kept = step_strategy(cfg).keeps_all_grads
    assert ("grad_workspace" in names) == (not kept)
    assert ("block.0.grad" in names) == kept
