"""Attention patterns of a prompt: the softmax weights each head gives each earlier position.

The model runs its ordinary forward (SDPA never returns the weights); a forward pre-hook on each
selected attention module recomputes that layer's weights from the same input with the module's
own projections and RoPE, so what is shown is what the layer computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from apr.errors import AprError, Finding


class AttentionInputError(AprError):
    """A prompt or a layer/head selection that cannot be shown."""


@dataclass
class AttentionMap:
    layer: int
    head: int
    tokens: list[str]
    weights: list[list[float]]  # [query][key], rows sum to 1, zero above the diagonal

    def to_dict(self) -> dict:
        return {"layer": self.layer, "head": self.head, "tokens": self.tokens, "weights": self.weights}


def _weights(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    b, s, _ = x.shape
    q, k, _ = attn.project(x, cos, sin)  # either attention kind (apr/model/llama.py)
    k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # GQA: each kv head serves a group
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(attn.head_dim)
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)[0]  # [heads, s, s]


def _check(values: list[int], limit: int, option: str) -> None:
    bad = [v for v in values if not 0 <= v < limit]
    if bad:
        raise AttentionInputError(f"{option} {bad[0]} does not exist: the model has {limit}", [Finding(
            "error", "inspect.selection", f"no such {option.strip('-')}", path=option, expected=f"0 to {limit - 1}",
            got=str(bad[0]))])


@torch.no_grad()
def attention_maps(loaded, prompt: str, layers: list[int] | None = None,
                   heads: list[int] | None = None) -> list[AttentionMap]:
    """One map per selected (layer, head) for ``prompt`` (default: every layer and head)."""
    model, tok = loaded.model, loaded.tokenizer
    arch = model.arch
    layers = list(range(arch.num_hidden_layers)) if not layers else layers
    heads = list(range(arch.num_attention_heads)) if not heads else heads
    _check(layers, arch.num_hidden_layers, "--layer")
    _check(heads, arch.num_attention_heads, "--head")
    ids = tok.encode(prompt, add_special_tokens=False).ids
    if not ids or len(ids) > loaded.context:
        raise AttentionInputError(
            f"--prompt is {len(ids)} tokens; attention can be shown for 1 to {loaded.context} (the model's context)",
            [Finding("error", "inspect.prompt_length", "prompt outside the context", path="--prompt",
                     expected=f"1 to {loaded.context} tokens", got=f"{len(ids)} tokens")])
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in layers:
        attn = model.model.layers[i].self_attn

        def hook(module, args, i=i):
            captured[i] = _weights(module, *args)
        handles.append(attn.register_forward_pre_hook(hook))
    try:
        model(torch.tensor([ids], device=loaded.device))
    finally:
        for h in handles:
            h.remove()
    tokens = [tok.decode([t]) for t in ids]
    return [AttentionMap(i, h, tokens, captured[i][h].tolist()) for i in layers for h in heads]
