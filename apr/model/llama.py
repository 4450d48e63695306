"""The LLaMA-style decoder, top to bottom in the order data flows through it.

RMSNorm -> rotary embeddings (with Llama 3's, linear, dynamic and YaRN scaling) -> attention (GQA,
SDPA; Qwen2's q/k/v biases, Mistral's sliding window) -> SwiGLU MLP (or Mixtral's mixture of experts,
apr/model/moe.py) -> decoder block -> model.
Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` exactly (Qwen2 and Mistral
use the same names: ``model.layers.0.self_attn.q_proj.weight``, ...), so ``state_dict()`` is an HF checkpoint without
renaming. Shapes, counts and init order come from ``apr.model.spec``.

The model is plain ``nn.Module`` code; the training engine (``apr.train.engine``) re-points every
parameter at a view of its group's flat buffer and drives the blocks one at a time.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from apr.config.schema import Architecture
from apr.kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_sum
from apr.model import spec
from apr.model.mla import LatentAttention
from apr.model.moe import SparseMoE
from apr.model.norm_rope import RMSNorm, apply_rope  # shared with apr/model/mla.py
from apr.model.time import TimedEmbedding, TimeEmbedding


def rope_frequencies(arch: Architecture, seq_len: int, device) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies ``[rope_dim / 2]`` (float32) for a forward over ``seq_len``
    positions, and the factor cos and sin are scaled by: plain RoPE, or ``arch.rope_scaling`` computed
    as transformers' ``modeling_rope_utils`` does for each type (same operations, same order).
    Decoupled attention's geometric part with a scaling turns at the first ``geo_dim / 2`` of the
    head's scaled frequencies (without one, ``spec.rope_base`` gives the same frequencies)."""
    dim, base, rs = spec.rope_dim(arch), spec.rope_base(arch), arch.rope_scaling
    if rs is not None and arch.decoupled_attention is not None:
        head, scale = rope_frequencies(arch.model_copy(update={"decoupled_attention": None}), seq_len, device)
        return head[:dim // 2], scale
    exponents = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
    if rs is None or rs.rope_type == "linear":  # linear: positions divided by factor, i.e. frequencies
        return 1.0 / (base ** exponents) / (1.0 if rs is None else rs.factor), 1.0
    if rs.rope_type == "dynamic":  # NTK: the base grows once a forward runs past max_position_embeddings
        longest = max(seq_len, arch.max_position_embeddings)
        base = base * ((rs.factor * longest / arch.max_position_embeddings) - (rs.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** exponents), 1.0
    original = rs.original_max_position_embeddings or arch.max_position_embeddings
    if rs.rope_type == "llama3":  # long wavelengths divided by factor, short ones kept, a ramp between
        inv_freq = 1.0 / (base ** exponents)
        low_wavelen, high_wavelen = original / rs.low_freq_factor, original / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (original / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: interpolated (divided by factor) below a ramp over dimensions, extrapolated above it
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rs.attention_factor
    if attention is None:
        attention = (float(mscale(rs.factor, rs.mscale) / mscale(rs.factor, rs.mscale_all_dim))
                     if rs.mscale and rs.mscale_all_dim else mscale(rs.factor))

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast or 32), correction_dim(rs.beta_slow or 1)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def rope_cos_sin(arch: Architecture, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[seq_len, rope_dim]`` in float32 (HF's rope, halves concatenated)."""
    inv_freq, scale = rope_frequencies(arch, seq_len, device)
    positions = torch.arange(seq_len, dtype=torch.float, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads and rotary positions (bidirectional when
    ``causal`` is False: the masked-LM objective, apr/train/losses.py ``MaskedLM``)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.n_heads = arch.num_attention_heads
        self.n_kv_heads = arch.kv_heads
        self.head_dim = self.key_dim = arch.head_dim  # key_dim: the cached key's width (apr.generate.decode)
        self.sliding_window = arch.sliding_window  # mistral: keys at most this many positions back, itself included
        self.causal = True  # False: every position attends to the whole sequence (training.mode: mlm)
        self.dropout = arch.dropout  # on the attention weights, in training mode only
        h, bias = arch.hidden_size, spec.qkv_bias(arch)  # qwen2: biases on q, k and v
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries and keys with RoPE applied, and values: ``[batch, heads, seq, dim]`` each."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if self.sliding_window is not None and s > self.sliding_window:
            pos = torch.arange(s, device=x.device)
            back = pos[:, None] - pos[None, :]  # query position minus key position
            mask = (back >= 0) & (back < self.sliding_window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self._p(), enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self._p(), enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))

    def _p(self) -> float:
        return self.dropout if self.training else 0.0


class DecoupledAttention(nn.Module):
    """Decoupled bottleneck attention: each head's score is a low-rank "semantic" query/key product
    without positions (``sem_dim`` per head) plus a "geometric" one with RoPE (``geo_dim`` per
    head), scaled as the full head would be (1 / sqrt(head_dim)); values and output as in
    ``Attention``. Keys are ``sem_dim + geo_dim`` wide, so the KV cache shrinks. The RoPE tables
    are the model's (``LlamaForCausalLM.rope``: ``geo_dim`` wide, base ``spec.rope_base``). See
    docs/design.md, "Upcycling into a new architecture"."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = arch.num_attention_heads, arch.kv_heads, arch.head_dim
        self.sem_dim, self.geo_dim = arch.decoupled_attention.sem_dim, arch.decoupled_attention.geo_dim
        self.key_dim = self.sem_dim + self.geo_dim
        self.causal = True  # as Attention's
        self.dropout = arch.dropout  # as Attention's
        h = arch.hidden_size
        self.q_sem_proj = nn.Linear(h, self.n_heads * self.sem_dim, bias=False)
        self.k_sem_proj = nn.Linear(h, self.n_kv_heads * self.sem_dim, bias=False)
        self.q_geo_proj = nn.Linear(h, self.n_heads * self.geo_dim, bias=False)
        self.k_geo_proj = nn.Linear(h, self.n_kv_heads * self.geo_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries and keys ``[batch, heads, seq, sem_dim + geo_dim]`` (semantic part, then the
        geometric part with RoPE), values ``[batch, kv_heads, seq, head_dim]``."""
        b, s, _ = x.shape

        def heads(proj, n, d):
            return proj(x).view(b, s, n, d).transpose(1, 2)

        q = torch.cat([heads(self.q_sem_proj, self.n_heads, self.sem_dim),
                       apply_rope(heads(self.q_geo_proj, self.n_heads, self.geo_dim), cos, sin)], dim=-1)
        k = torch.cat([heads(self.k_sem_proj, self.n_kv_heads, self.sem_dim),
                       apply_rope(heads(self.k_geo_proj, self.n_kv_heads, self.geo_dim), cos, sin)], dim=-1)
        return q, k, heads(self.v_proj, self.n_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.head_dim ** -0.5,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, arch: Architecture):
        super().__init__()
        h, inter = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with ``arch.dropout``, dropout on the
    attention weights and on each branch before it joins the residual stream, in training mode only
    (``model.eval()``: validation, generation, evaluation)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.dropout = arch.dropout
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.mla is not None:  # multi-head latent attention
            self.self_attn = LatentAttention(arch)
        else:
            self.self_attn = Attention(arch) if arch.decoupled_attention is None else DecoupledAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch) if arch.moe is None else SparseMoE(arch)  # moe: router and experts (apr/model/moe.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not (self.dropout and self.training):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + F.dropout(self.self_attn(self.input_layernorm(x), cos, sin), self.dropout)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.dropout)


class LlamaModel(nn.Module):
    """Embedding, the blocks and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        if arch.time is None:
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        else:  # time conditioning: the token embedding adds each row's time embedding (apr/model/time.py)
            time = TimeEmbedding(arch)
            self.embed_tokens = TimedEmbedding(arch.vocab_size, arch.hidden_size, time)
            self.time_embedding = time  # after embed_tokens: parameters in spec.param_specs order
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The whole decoder. ``lm_head`` is absent when the embedding is tied to the head."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for ``seq_len`` positions, cached per device."""
        key = (seq_len, str(device))
        if key not in self._rope:
            self._rope[key] = rope_cos_sin(self.arch, seq_len, device)
        return self._rope[key]

    def hidden_states(self, input_ids: torch.Tensor, residual_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding and blocks: the final block's output, before the final norm.

        ``residual_dtype`` keeps the residual stream (each block's input and output) in that dtype,
        as the interleaved engine stores its activation checkpoints; None leaves it as computed.
        """
        cos, sin = self.rope(input_ids.shape[1], input_ids.device)
        x = self.model.embed_tokens(input_ids)
        if residual_dtype is not None:
            x = x.to(residual_dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
            if residual_dtype is not None:
                x = x.to(residual_dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        loss_chunk_size: int | None = None,
        residual_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (float32) without targets; with targets, the mean
        cross-entropy computed over sequence chunks of ``loss_chunk_size`` positions, so the full
        logits never exist."""
        hidden = self.hidden_states(input_ids, residual_dtype)
        if targets is None:
            return F.linear(self.model.norm(hidden), self.head_weight).float()
        return self.loss(hidden, targets, chunk_size=loss_chunk_size or input_ids.shape[1])

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, *, chunk_size: int, backend=None,
             compute_dtype: torch.dtype | None = None, norm_context=None, total: bool = False) -> torch.Tensor:
        """The causal-LM loss from the last block's output (``hidden_states``): the final norm
        (under ``norm_context``, e.g. the run's autocast), then the LM head and cross-entropy over
        sequence chunks of ``chunk_size`` positions, so the full logits never exist. The mean
        (differentiable), or with ``total`` the sum without gradients (evaluation). The one loss
        entry point of engines and evaluation (docs/design.md, "The composed engine")."""
        with norm_context if norm_context is not None else contextlib.nullcontext():
            h = self.model.norm(hidden)
        fn = linear_cross_entropy_sum if total else linear_cross_entropy
        return fn(h, self.head_weight, targets, chunk_size=chunk_size, backend=backend, compute_dtype=compute_dtype)


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Deterministic init from ``seed``: every matrix N(0, initializer_range), every norm 1, every
    bias 0.

    Drawn on the CPU from one generator in ``spec.param_specs`` order, then copied to the model's
    device, so the same seed gives the same weights on any device.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = dict(model.named_parameters())
    for ps in spec.param_specs(model.arch):
        p = params[ps.name]
        if len(ps.shape) == 1:
            p.fill_(0.0 if ps.name.endswith(".bias") else 1.0)
        else:
            w = torch.empty(ps.shape, dtype=torch.float32).normal_(0.0, model.arch.initializer_range, generator=gen)
            p.copy_(w)


def build_model(arch: Architecture, seed: int, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """A freshly initialised float32 model on ``device``."""
    model = LlamaForCausalLM(arch)
    init_weights(model, seed)
    return model.to(device)
