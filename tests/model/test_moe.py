"""The mixture-of-experts MLP (apr/model/moe.py): each token's output is its top-k experts' SwiGLU
outputs weighted by the renormalised router probabilities, gradients included; the balance loss is
Switch's; the spec names and counts every parameter the model holds."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from apr.config.schema import Architecture
from apr.model import spec
from apr.model.llama import build_model
from apr.model.moe import balance_loss

ARCH = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 24,
        "vocab_size": 40, "max_position_embeddings": 16}


def _arch(**moe) -> Architecture:
    return Architecture(**ARCH, moe={"num_experts": 4, "top_k": 2, **moe})


def _by_hand(block, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's softmax, its k largest probabilities over their sum, each chosen
    expert's down(silu(gate x) * up x)."""
    inter = block.experts.down_proj.shape[-1]
    out = []
    for row in x:
        probs = torch.softmax(block.gate.weight @ row, dim=-1)
        top, chosen = probs.topk(block.gate.top_k)
        y = torch.zeros_like(row)
        for weight, e in zip(top / top.sum(), chosen.tolist(), strict=True):
            w = block.experts.gate_up_proj[e]
            y = y + weight * (block.experts.down_proj[e] @ (F.silu(w[:inter] @ row) * (w[inter:] @ row)))
        out.append(y)
    return torch.stack(out)


def test_each_token_gets_its_top_k_experts_weighted_by_the_renormalised_router_and_the_same_gradients():
    model = build_model(_arch(expert_intermediate_size=8), seed=3)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    got = block(x)
    want = _by_hand(block, x.reshape(-1, 16)).view_as(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    params = [x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    upstream = torch.randn_like(got)
    grads = torch.autograd.grad((got * upstream).sum(), params)
    wants = torch.autograd.grad((want * upstream).sum(), params)
    for g, w in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # the routing figures the loss part reads: every token's k rows counted once
    assert block.load.tolist() == torch.bincount(
        torch.softmax(x.detach().reshape(-1, 16) @ block.gate.weight.T, -1).topk(2).indices.reshape(-1),
        minlength=4).tolist() and int(block.load.sum()) == 14 * 2


def test_the_balance_loss_is_one_when_balanced_and_the_expert_count_when_one_expert_takes_all():
    uniform = torch.full((6, 4), 0.25)
    assert balance_loss(uniform, torch.tensor([3, 3, 3, 3])).item() == 1.0
    one_expert = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 6)
    assert balance_loss(one_expert, torch.tensor([6, 0, 0, 0])).item() == 4.0
    # by hand: shares (0.5, 0.25, 0.25, 0), mean probs (0.4, 0.3, 0.2, 0.1): 4 x (0.2 + 0.075 + 0.05) = 1.3
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 2)
    assert math.isclose(balance_loss(probs, torch.tensor([2, 1, 1, 0])).item(), 1.3, rel_tol=1e-6)


def test_the_spec_names_every_parameter_with_its_shape_and_counts_the_active_ones():
    arch = _arch(expert_intermediate_size=8)
    model = build_model(arch, seed=0)
    held = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert held == {p.name: p.shape for p in spec.param_specs(arch)}
    assert held["model.layers.1.mlp.experts.gate_up_proj"] == (4, 16, 16)
    assert spec.param_count(arch) == sum(p.numel() for p in model.parameters())
    # a token uses the router and 2 of the 4 experts (3 matrices of 8 x 16 each)
    assert spec.active_param_count(arch) == spec.param_count(arch) - 2 * 2 * 3 * 8 * 16
    dense = Architecture(**ARCH)
    assert spec.flops_per_token(arch, 8) - spec.flops_per_token(dense, 8) == \
        6 * 2 * (4 * 16 + 2 * 3 * 8 * 16 - 3 * 24 * 16)  # router + 2 experts in place of the dense MLP



def test_experts_run_on_fake_tensors_with_the_rows_split_evenly():
    """`apr train plan --trace` runs the engine on fake tensors, which hold no routing: each expert
    then takes an even share of the rows (the same total), and the forward and backward run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from apr.model.llama import LlamaForCausalLM
    from apr.model.moe import _host_counts

    with FakeTensorMode():
        model = LlamaForCausalLM(_arch())
        ids = torch.randint(0, 40, (2, 7))
        model(ids[:, :-1], ids[:, 1:]).backward()
        load = model.model.layers[0].mlp.load
        assert _host_counts(load, 2 * 6 * 2) == [6, 6, 6, 6] and _host_counts(load, 10) == [3, 3, 2, 2]
        assert model.model.layers[0].mlp.experts.gate_up_proj.grad.shape == (4, 48, 16)
