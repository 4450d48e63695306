"""The model's shapes and what follows from them, without torch: parameter names and counts,
FLOPs per token, and the buffer plan the trainer allocates from and the plan sums (DESIGN.md
decision 1). One source of truth for `apr train plan` and `apr train apply`.
"""

from __future__ import annotations

from dataclasses import dataclass

from apr.config.schema import AprConfig, Architecture, MixedPrecision

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


@dataclass(frozen=True)
class ParamSpec:
    name: str  # Hugging Face Llama name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    group: str  # "embed", "block.{i}", "head"
    decay: bool  # weight decay applies (matrices yes, norms no)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def head_dim(arch: Architecture) -> int:
    return arch.hidden_size // arch.num_attention_heads


def block_param_specs(arch: Architecture, i: int) -> list[ParamSpec]:
    """Parameters of block ``i`` in the order they sit in the block's flat buffer."""
    h, hd, inter = arch.hidden_size, head_dim(arch), arch.intermediate_size
    nq, nkv = arch.num_attention_heads, arch.kv_heads
    p = f"model.layers.{i}."
    g = f"block.{i}"
    return [
        ParamSpec(p + "input_layernorm.weight", (h,), g, False),
        ParamSpec(p + "self_attn.q_proj.weight", (nq * hd, h), g, True),
        ParamSpec(p + "self_attn.k_proj.weight", (nkv * hd, h), g, True),
        ParamSpec(p + "self_attn.v_proj.weight", (nkv * hd, h), g, True),
        ParamSpec(p + "self_attn.o_proj.weight", (h, nq * hd), g, True),
        ParamSpec(p + "post_attention_layernorm.weight", (h,), g, False),
        ParamSpec(p + "mlp.gate_proj.weight", (inter, h), g, True),
        ParamSpec(p + "mlp.up_proj.weight", (inter, h), g, True),
        ParamSpec(p + "mlp.down_proj.weight", (h, inter), g, True),
    ]


def embed_param_specs(arch: Architecture, decay_embeddings: bool = False) -> list[ParamSpec]:
    return [ParamSpec("model.embed_tokens.weight", (arch.vocab_size, arch.hidden_size), "embed", decay_embeddings)]


def head_param_specs(arch: Architecture) -> list[ParamSpec]:
    """Final norm and (unless tied to the embedding) the LM head."""
    specs = [ParamSpec("model.norm.weight", (arch.hidden_size,), "head", False)]
    if not arch.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (arch.vocab_size, arch.hidden_size), "head", True))
    return specs


def param_specs(arch: Architecture, decay_embeddings: bool = False) -> list[ParamSpec]:
    """Every parameter, in Hugging Face names: embedding, blocks, final norm, head."""
    specs = embed_param_specs(arch, decay_embeddings)
    for i in range(arch.num_hidden_layers):
        specs += block_param_specs(arch, i)
    return specs + head_param_specs(arch)


def block_numel(arch: Architecture) -> int:
    return sum(p.numel for p in block_param_specs(arch, 0))


def param_count(arch: Architecture) -> int:
    """Exact number of trainable parameters (tied embeddings counted once)."""
    return sum(p.numel for p in param_specs(arch))


def non_embedding_param_count(arch: Architecture) -> int:
    """Parameters that take part in matmuls per token: blocks, final norm and LM head."""
    head = arch.vocab_size * arch.hidden_size  # the LM head matmul runs even when tied
    return arch.num_hidden_layers * block_numel(arch) + arch.hidden_size + head


def flops_per_token(arch: Architecture, seq_len: int) -> int:
    """Training FLOPs per token: 6N (forward + backward of the matmuls) plus the attention term
    12 * layers * hidden * seq_len (PaLM, appendix B). Recompute in the interleaved engine is not
    counted: this is the model-FLOPs figure MFU is quoted against."""
    n = non_embedding_param_count(arch)
    return 6 * n + 12 * arch.num_hidden_layers * arch.hidden_size * seq_len


# ---------------------------------------------------------------------------------- buffer plan


@dataclass(frozen=True)
class Buffer:
    """A named device allocation of the trainer."""

    name: str
    component: str  # row of the plan's memory table
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def compute_dtype(precision: MixedPrecision | str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[str(precision)]


def buffer_plan(config: AprConfig) -> list[Buffer]:
    """The trainer's persistent device buffers, as allocated by the interleaved engine.

    Weights, optimizer state and gradient buffers are float32 (master weights); activation
    checkpoints are kept in the compute dtype. Activations inside one block and allocator slack are
    modelled separately (apr/plan/memory.py), calibrated against measured peaks.
    """
    arch = config.model.architecture
    tr = config.training
    b, s, h, v = config.data.batch_size, config.data.seq_len, arch.hidden_size, arch.vocab_size
    cdt = compute_dtype(tr.mixed_precision)
    bufs: list[Buffer] = []

    groups: list[tuple[str, int]] = [("embed", v * h)]
    groups += [(f"block.{i}", block_numel(arch)) for i in range(arch.num_hidden_layers)]
    groups.append(("head", sum(p.numel for p in head_param_specs(arch))))
    for name, numel in groups:
        bufs.append(Buffer(f"{name}.flat_params", "weights", (numel,), "float32"))
    for name, numel in groups:
        bufs.append(Buffer(f"{name}.adam_m", "adamw_m", (numel,), "float32"))
        bufs.append(Buffer(f"{name}.adam_v", "adamw_v", (numel,), "float32"))

    # One shared workspace sized for the largest group; embedding and head gradients are produced at
    # the ends of the backward walk and use it too. Accumulation keeps every group's gradient across
    # micro-batches instead (exact global clipping is then free; without accumulation it costs a
    # norm-only backward pass, not memory).
    keeps_all_grads = tr.gradient_accumulation > 1
    if str(tr.engine) == "standard" or keeps_all_grads:
        for name, numel in groups:
            bufs.append(Buffer(f"{name}.grad", "gradients", (numel,), "float32"))
    else:
        bufs.append(Buffer("grad_workspace", "gradients", (max(n for _, n in groups),), "float32"))

    if str(tr.engine) == "interleaved":
        bufs.append(Buffer("block_inputs", "activation_checkpoints",
                           (arch.num_hidden_layers + 1, b, s, h), cdt))
    chunk = min(tr.loss_chunk_size, s)
    bufs.append(Buffer("logits_chunk", "logits_chunk", (b, chunk, v), "float32"))
    bufs.append(Buffer("logits_chunk_grad", "logits_chunk", (b, chunk, v), "float32"))
    bufs.append(Buffer("token_ids", "inputs", (b, s + 1), "int64"))
    return bufs
