"""Mixture of experts: a block's MLP as a router and ``num_experts`` SwiGLU experts
(``model.architecture.moe``; docs/moe.md), top to bottom in the order data flows through it.

Router -> each token's ``top_k`` experts, their gate weights renormalised to sum to 1 -> the
token's rows grouped by expert (a stable sort) -> each expert's SwiGLU over its rows -> the rows put
back in token order -> the gate-weighted sum over the token's ``top_k`` outputs. Dropless: every
token reaches its experts, however uneven the routing.

Module and parameter names follow Hugging Face's ``MixtralForCausalLM`` (transformers 5) exactly:
``model.layers.0.mlp.gate.weight`` (the router, ``[experts, hidden]``),
``mlp.experts.gate_up_proj`` (``[experts, 2 x expert_intermediate, hidden]``, gate rows first) and
``mlp.experts.down_proj`` (``[experts, hidden, expert_intermediate]``), so ``state_dict()`` is a
Mixtral checkpoint without renaming.

Deterministic on every device: no operation accumulates into shared rows (the rows are reordered
by a permutation whose backward is the inverse permutation, and each token's ``top_k`` outputs are
summed in slot order), so two runs, and a resumed run, compute the same bits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from apr.config.schema import Architecture
from apr.model import spec


class _Reorder(torch.autograd.Function):
    """``x[order]`` for a permutation ``order``; the gradient goes back through ``inverse``, a gather
    (indexing's own backward accumulates, which a GPU does in no fixed order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x[order]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class Router(nn.Module):
    """Router logits over the experts, softmax in float32, the ``top_k`` largest probabilities
    renormalised to sum to 1 (Mixtral's ``MixtralTopKRouter``)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.top_k = arch.moe.top_k
        self.weight = nn.Parameter(torch.empty(arch.moe.num_experts, arch.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[tokens, hidden]`` -> probabilities ``[tokens, experts]`` (float32), the top-k gate
        weights ``[tokens, top_k]`` (float32) and expert indices ``[tokens, top_k]``."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        return probs, top / top.sum(dim=-1, keepdim=True), chosen


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stored as two 3-D tensors (Mixtral's ``MixtralExperts``)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        e, h, inter = arch.moe.num_experts, arch.hidden_size, spec.expert_intermediate_size(arch)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
        """x ``[tokens, hidden]``; ``chosen``/``weights`` ``[tokens, top_k]``; ``counts``: rows per expert."""
        tokens, k = chosen.shape
        order = torch.argsort(chosen.reshape(-1), stable=True)  # slot t*k + j, grouped by expert
        inverse = torch.argsort(order)
        slots = x.unsqueeze(1).expand(tokens, k, x.shape[-1]).reshape(tokens * k, -1)
        rows = _Reorder.apply(slots, order, inverse)
        outs = []
        for part, gate_up, down in zip(rows.split(counts), self.gate_up_proj.unbind(0), self.down_proj.unbind(0),
                                       strict=True):
            gate, up = F.linear(part, gate_up).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, down))
        y = _Reorder.apply(torch.cat(outs), inverse, order).view(tokens, k, -1)
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)


class SparseMoE(nn.Module):
    """The block's ``mlp`` under ``model.architecture.moe`` (Mixtral's ``MixtralSparseMoeBlock``).

    Each forward leaves its routing figures on the module for the loss part and the step log
    (apr/train/losses.py): ``balance`` (the load-balancing loss, differentiable through the router)
    and ``load`` (rows routed to each expert, ``[experts]`` int64, no gradient)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.num_experts = arch.moe.num_experts
        self.gate = Router(arch)
        self.experts = Experts(arch)
        self.balance: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, chosen = self.gate(flat)
        experts = torch.arange(self.num_experts, device=chosen.device)
        load = (chosen.reshape(-1, 1) == experts).sum(dim=0)  # rows per expert, in a fixed order
        self.balance, self.load = balance_loss(probs, load), load.detach()
        return self.experts(flat, chosen, weights, _host_counts(load, chosen.numel())).reshape(shape)


def _host_counts(load: torch.Tensor, rows: int) -> list[int]:
    """Rows per expert on the host (``rows`` of them: tokens x top_k). Fake tensors (`apr train plan
    --trace`) have no values: there the rows are split as evenly as they go, the same total, so the
    traced bytes are the step's."""
    if is_fake(load):
        n = load.shape[0]
        return [rows // n + (e < rows % n) for e in range(n)]
    return load.tolist()


def balance_loss(probs: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4) for top-k routing:
    ``experts x sum_e share_e x mean_prob_e``, ``share_e`` the fraction of the routed rows that went
    to expert ``e`` (no gradient) and ``mean_prob_e`` its mean router probability over the tokens.
    1.0 when the routing is uniform; ``experts`` when one expert takes everything."""
    share = load.to(torch.float32) / load.sum()
    return probs.shape[-1] * (share * probs.mean(dim=0)).sum()
