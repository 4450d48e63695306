"""The stacking trunk transform (apr/model/trunk.py): each stack stored in its stage's precision,
adapters only on trunk blocks and starting where the stored weights are, NF4 state kept exactly
through a checkpoint, and the merged export computing what the live trunk computes."""

from __future__ import annotations

import pytest
import torch

from apr.config.schema import AprConfig
from apr.model.llama import build_model
from apr.model.spec import optimizer_groups, stack_bytes, trunk_specs
from apr.model.trunk import FrozenLinear, apply_trunk, load_trunk_state, merged_weights, trunk_state
from apr.steps import stacking
from tests.train.tiny import make_config


def _staged(stacking_cfg: dict, step: int) -> AprConfig:
    config = make_config(model={"architecture": {"num_hidden_layers": 4}, "stacking": stacking_cfg})
    return stacking.config_at(config, step)


THREE = {"stages": [{"blocks": 2, "steps": 3, "precision": "bf16"}, {"blocks": 3, "steps": 3, "precision": "fp16"},
                    {"blocks": 4}], "earlier": "freeze", "trunk_lora": {"rank": 2, "targets": "attention"}}


def test_each_stack_is_stored_in_its_stages_precision_and_prepend_puts_the_trunk_on_top():
    config = _staged(THREE, 7)  # stage 2: blocks 0-1 from stage 0, block 2 from stage 1
    assert stacking.trunk_storage(config) == {0: "bf16", 1: "bf16", 2: "fp16"}
    prepended = _staged({**THREE, "building_mode": "prepend"}, 7)
    assert stacking.block_origins(prepended) == [2, 1, 0, 0]
    assert stacking.trunk_storage(prepended) == {1: "fp16", 2: "bf16", 3: "bf16"}
    model = build_model(config.model.architecture, 5, device="cpu")
    apply_trunk(model, config, seed=5)
    layers = model.model.layers
    q0 = layers[0].self_attn.q_proj.weight
    assert q0.dtype == torch.bfloat16 and not q0.requires_grad
    assert layers[2].mlp.up_proj.weight.dtype == torch.float16 and isinstance(layers[2].mlp.up_proj, FrozenLinear)
    assert layers[3].mlp.up_proj.weight.dtype == torch.float32 and layers[3].mlp.up_proj.weight.requires_grad
    trained = {s.name for _, specs in optimizer_groups(config) for s in specs}
    assert "model.layers.0.self_attn.q_proj.lora_A" in trained
    assert "model.layers.3.self_attn.q_proj.lora_A" not in trained
    assert "model.layers.0.self_attn.q_proj.weight" not in trained and "model.layers.3.mlp.up_proj.weight" in trained
    by_stack = {s["stack"]: s for s in stack_bytes(config)}
    assert by_stack[0]["storage"] == "bf16" and by_stack[0]["trains"] == "adapters" and by_stack[2]["trains"] == "all"
    assert by_stack[0]["weight_bytes"] < by_stack[2]["weight_bytes"] * by_stack[0]["blocks"]  # half precision


def test_adapters_start_at_the_stored_weights_function():
    config = _staged(THREE, 7)
    plain = build_model(config.model.architecture, 5, device="cpu")
    with torch.no_grad():  # what the trunk computes: its weights rounded to their storage
        for i, dtype in ((0, torch.bfloat16), (1, torch.bfloat16), (2, torch.float16)):
            for name, p in plain.model.layers[i].named_parameters():
                if "proj" in name:
                    p.copy_(p.to(dtype).float())
    model = build_model(config.model.architecture, 5, device="cpu")
    apply_trunk(model, config, seed=5)
    ids = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=0)


def test_an_nf4_trunk_round_trips_through_its_checkpoint_tensors_exactly_and_merges_like_the_live_model():
    config = _staged({"stages": [{"blocks": 2, "steps": 3}, {"blocks": 4}], "earlier": "freeze",
                      "trunk_strategy": "qlora"}, 5)
    model = build_model(config.model.architecture, 5, device="cpu")
    apply_trunk(model, config, seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
    state = trunk_state(model, config)
    assert {n: tuple(t.shape) for n, t in state.items()} == dict(trunk_specs(config))
    assert all(t.dtype == torch.float32 for t in state.values())  # checkpoints hold float32 only
    other = build_model(config.model.architecture, 9, device="cpu")
    apply_trunk(other, config, seed=9)
    load_trunk_state(other, config, state)
    again = trunk_state(other, config)
    assert all(again[k].equal(v) for k, v in state.items())
    tensors = {**{n: p.detach() for n, p in model.named_parameters() if p.requires_grad or "lora" in n}, **state}
    plain = build_model(config.model.architecture, 0, device="cpu")
    plain.load_state_dict(merged_weights(tensors, config))
    ids = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_an_nf4_trunk_runs_on_the_gpu_under_bf16_autocast_as_on_the_cpu():
    config = _staged({"stages": [{"blocks": 2, "steps": 3}, {"blocks": 4}], "earlier": "freeze",
                      "trunk_strategy": "qlora"}, 5)
    model = build_model(config.model.architecture, 5, device="cpu")
    apply_trunk(model, config, seed=5)
    ids = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    state = trunk_state(model, config)
    model = model.to("cuda")
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "NF4Tensor"  # moved in 4 bits
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = model(ids.cuda())
    got.float().sum().backward()  # the adapters get gradients through the dequantized trunk
    assert model.model.layers[0].self_attn.q_proj.lora_A.grad is not None
    torch.testing.assert_close(got.float().cpu(), want, rtol=5e-2, atol=5e-2)
    assert all(v.cpu().equal(state[k]) for k, v in trunk_state(model, config).items())  # the same codes


def test_progressive_adapters_are_counted_per_stack_as_the_model_builds_them_and_start_at_nothing():
    config = _staged({**THREE, "progressive_lora": {"rank": 1, "alpha": 2}}, 7)  # stage 2 of three
    model = build_model(config.model.architecture, 5, device="cpu")
    plain = build_model(config.model.architecture, 5, device="cpu")
    apply_trunk(model, config, seed=5)
    built = {i: sum(p.numel() for n, p in model.model.layers[i].named_parameters() if ".lora_" in n)
             for i in range(4)}
    stacks = {s["stack"]: s for s in stack_bytes(config)}
    assert stacks[0]["adapters"] == 2 and stacks[1]["adapters"] == 1 and stacks[2]["adapters"] == 0
    assert stacks[0]["adapter_params"] == built[0] + built[1] and stacks[1]["adapter_params"] == built[2]
    assert model.model.layers[0].self_attn.q_proj.lora_A_s2.shape[0] == 1 and built[3] == 0
    ids = torch.randint(0, 53, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # lora_B zero for every adapter: the grow changes nothing but the storage
        for i, dtype in ((0, torch.bfloat16), (1, torch.bfloat16), (2, torch.float16)):
            for name, p in plain.model.layers[i].named_parameters():
                if "proj" in name:
                    p.copy_(p.to(dtype).float())
        torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=0)
