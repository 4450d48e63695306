"""RMSNorm and rotary position embeddings applied to queries and keys: the pieces every attention
module uses (apr/model/llama.py's ``Attention`` and ``DecoupledAttention``, apr/model/mla.py's
``LatentAttention``). The RoPE tables themselves are ``apr.model.llama.rope_cos_sin``'s."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the input dtype (as HF Llama does)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[batch, heads, seq, head_dim]``; cos/sin: ``[seq, head_dim]``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
