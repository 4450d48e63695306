"""Incremental decoding with a key/value cache, over the modules of ``apr.model.llama``.

The model file stays a plain training forward; this module walks the same layers (same RMSNorm,
projections, RoPE tables and SDPA) and keeps each layer's keys and values for the positions already
seen, so a new token costs one position's work instead of the whole prefix again.

Rows of a batch may have different prompt lengths: prompts are left-padded, each row's positions
count from its first real token, and padded keys are masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apr.model.llama import LlamaForCausalLM


class KVCache:
    """Keys and values of every layer, ``[layers, batch, kv_heads, capacity, key_dim | head_dim]``
    (keys are narrower than values under decoupled attention). Under multi-head latent attention
    (apr/model/mla.py) only what the keys and values are expanded from: each layer's latent
    ``[layers, batch, capacity, kv_lora_rank]`` and shared RoPE key ``[layers, batch, 1, capacity,
    qk_rope_head_dim]`` (``k`` and ``v`` are then None)."""

    def __init__(self, model: LlamaForCausalLM, batch: int, capacity: int):
        attn = model.model.layers[0].self_attn
        w = model.model.embed_tokens.weight
        layers = len(model.model.layers)
        self.k = self.v = self.latent = self.rope_key = None
        if hasattr(attn, "kv_lora_rank"):  # latent attention
            self.latent = torch.empty((layers, batch, capacity, attn.kv_lora_rank), dtype=w.dtype, device=w.device)
            self.rope_key = torch.empty((layers, batch, 1, capacity, attn.rope_dim), dtype=w.dtype, device=w.device)
        else:
            shape = (layers, batch, attn.n_kv_heads, capacity)
            self.k = torch.empty((*shape, attn.key_dim), dtype=w.dtype, device=w.device)
            self.v = torch.empty((*shape, attn.head_dim), dtype=w.dtype, device=w.device)
        self.length = 0  # positions filled (padding included)
        self.capacity = capacity
        self.batch = batch

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.latent, self.rope_key) if t is not None)

    @property
    def bytes_per_token(self) -> int:
        """What the cache holds per position of one row: keys and values (or latents and RoPE keys)
        of every layer."""
        return self.nbytes // (self.batch * self.capacity)


def _attend(layer, x, cos, sin, cache: KVCache, index: int, mask) -> torch.Tensor:
    attn = layer.self_attn
    b, t, _ = x.shape
    start, end = cache.length, cache.length + t
    if cache.latent is not None:  # latent attention: cache the latent and RoPE key, attend in latent space
        latent, k_rope = attn.latent(x, cos, sin)
        cache.latent[index, :, start:end] = latent
        cache.rope_key[index, :, :, start:end] = k_rope
        return attn.attend_latent(x, cos, sin, cache.latent[index, :, :end], cache.rope_key[index, :, :, :end], mask,
                                  is_causal=start == 0 and t > 1)
    q, k, v = attn.project(x, cos, sin)
    cache.k[index, :, :, start:end] = k
    cache.v[index, :, :, start:end] = v
    keys, values = cache.k[index, :, :, :end], cache.v[index, :, :, :end]
    gqa = attn.n_kv_heads != attn.n_heads
    if mask is None:  # no padding: causal over the new positions (a prefill from empty) or all keys
        y = F.scaled_dot_product_attention(q, keys, values, is_causal=start == 0 and t > 1, enable_gqa=gqa,
                                           scale=attn.head_dim ** -0.5)
    else:
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=attn.head_dim ** -0.5)
    return attn.o_proj(y.transpose(1, 2).reshape(b, t, attn.n_heads * attn.head_dim))


@torch.inference_mode()
def forward_cached(model: LlamaForCausalLM, ids: torch.Tensor, cache: KVCache,
                   pad: torch.Tensor | None = None) -> torch.Tensor:
    """Feed ``ids`` ``[batch, t]`` after the ``cache.length`` positions already cached; return the
    float32 logits of the last position ``[batch, vocab]``.

    ``pad`` ``[batch]`` is the number of left-padding positions of each row (None: no padding); a
    row's RoPE position is its cache position minus its padding.
    """
    b, t = ids.shape
    start, end = cache.length, cache.length + t
    if end > cache.capacity:
        raise ValueError(f"the cache holds {cache.capacity} positions; {end} were asked for")
    cos_all, sin_all = model.rope(cache.capacity, ids.device)
    mask = None
    window = model.arch.sliding_window  # mistral: keys more than window - 1 positions back are masked
    if pad is None:
        cos, sin = cos_all[start:end], sin_all[start:end]
        if window is not None and end > window:
            back = torch.arange(start, end, device=ids.device)[:, None] - torch.arange(end, device=ids.device)[None, :]
            mask = ((back >= 0) & (back < window))[None, None]
    else:
        positions = (torch.arange(start, end, device=ids.device)[None, :] - pad[:, None]).clamp(min=0)
        cos, sin = cos_all[positions][:, None], sin_all[positions][:, None]  # [b, 1, t, head_dim]
        key_pos = torch.arange(end, device=ids.device)
        query_pos = torch.arange(start, end, device=ids.device)
        causal = key_pos[None, :] <= query_pos[:, None]  # [t, end]
        if window is not None:
            causal = causal & (query_pos[:, None] - key_pos[None, :] < window)
        real = key_pos[None, :] >= pad[:, None]  # [b, end]
        mask = (causal[None] & real[:, None])[:, None]  # [b, 1, t, end]
        # a padded query row sees no real key; let it see itself so softmax stays finite (it is discarded)
        mask = mask | (key_pos[None, None, None, :] == query_pos[None, None, :, None])
    x = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        x = x + _attend(layer, layer.input_layernorm(x), cos, sin, cache, i, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    cache.length = end
    h = model.model.norm(x[:, -1])
    return F.linear(h, model.head_weight).float()


@torch.inference_mode()
def forward_full(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the last position recomputed from the whole sequence (no cache; one row or rows
    without padding): the reference the cache is tested against."""
    return model(ids)[:, -1].float()
