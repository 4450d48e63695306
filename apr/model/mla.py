"""Multi-head latent attention (DeepSeek-V2's MLA): ``model.architecture.attention: {kind: mla}``.

Each token's keys and values come from one compressed latent of ``kv_lora_rank`` (normed), expanded
per head by ``kv_b_proj``, plus one RoPE key of ``qk_rope_head_dim`` shared by every head. A head's
query and key are ``head_dim`` wide: a position-free part (``head_dim - qk_rope_head_dim``) then the
RoPE part; values are ``head_dim`` wide. Queries come from a full projection or, with
``q_lora_rank``, through a normed latent of that width.

Training expands the latent to per-head keys and values and runs SDPA, as ``Attention`` does.
Generation (apr/generate/decode.py) caches only the latent and the RoPE key and attends in the
latent space: ``kv_b_proj``'s key half is folded into the queries and its value half applied after
the attention, so the cache never holds per-head keys or values.

Parameter names are transformers' ``DeepseekV3Attention``'s (``q_proj`` or ``q_a_proj``/
``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``); shapes and init order come from ``apr.model.spec``. See docs/mla.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from apr.config.schema import Architecture
from apr.model.norm_rope import RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6  # the latents' RMSNorm epsilon: DeepSeek's (its config's rms_norm_eps is the blocks' only)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention (bidirectional when ``causal`` is False, as ``Attention``)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        mla = arch.mla
        h = arch.hidden_size
        self.n_heads = self.n_kv_heads = arch.num_attention_heads  # every head has its own keys and values
        self.head_dim = self.key_dim = arch.head_dim
        self.rope_dim, self.kv_lora_rank, self.q_lora_rank = mla.qk_rope_head_dim, mla.kv_lora_rank, mla.q_lora_rank
        self.nope_dim = self.head_dim - self.rope_dim
        self.causal = True  # as Attention's (training.mode: mlm sets it False)
        self.dropout = arch.dropout  # on the attention weights, in training mode only
        q_width = self.n_heads * self.head_dim
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.head_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's position-free query part and its RoPE part (rotated): ``[batch, heads, seq, dim]``."""
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, apply_rope(q_rope, cos, sin)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a token leaves for later positions: the normed latent ``[batch, seq, kv_lora_rank]``
        and the shared rotated RoPE key ``[batch, 1, seq, qk_rope_head_dim]`` (the KV cache's two tensors)."""
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(latent), apply_rope(k_rope.unsqueeze(1), cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values ``[batch, heads, seq, head_dim]`` each, keys and values expanded
        from the latent (RoPE part last in queries and keys)."""
        b, s, _ = x.shape
        q_nope, q_rope = self.queries(x, cos, sin)
        latent, k_rope = self.latent(x, cos, sin)
        kv = self.kv_b_proj(latent).view(b, s, self.n_heads, self.nope_dim + self.head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        return torch.cat([q_nope, q_rope], dim=-1), k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.head_dim ** -0.5,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))

    def attend_latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, latent: torch.Tensor,
                      k_rope: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """``x``'s positions attending over cached ones held compressed (``latent`` ``[batch, keys,
        kv_lora_rank]``, ``k_rope`` ``[batch, 1, keys, qk_rope_head_dim]``): scores are the absorbed
        query ``q_nope W_uk`` against the latent plus the RoPE parts, and the output the attended
        latent through ``W_uv``; the same attention as ``forward`` without per-head keys or values."""
        b, t, _ = x.shape
        q_nope, q_rope = self.queries(x, cos, sin)
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :self.nope_dim], w[:, self.nope_dim:]
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope], dim=-1)
        k = torch.cat([latent.unsqueeze(1), k_rope], dim=-1)
        y = F.scaled_dot_product_attention(q, k, latent.unsqueeze(1), attn_mask=mask,
                                           is_causal=is_causal and mask is None, scale=self.head_dim ** -0.5,
                                           enable_gqa=True)
        y = torch.einsum("bhtr,hvr->bhtv", y, w_uv)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
