"""The model's shapes and what follows from them, without torch: parameter names and counts,
FLOPs per token, and the buffer plan the trainer allocates from and the plan sums (docs/design.md,
"The buffer plan"). One source of truth for `apr train plan` and `apr train apply`.
"""

from __future__ import annotations

from dataclasses import dataclass

from apr.config.schema import AprConfig, Architecture, LoraConfig, MixedPrecision
from apr.steps.execution import Execution, from_config, gradient_source
from apr.steps.strategy import step_strategy

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


def block_param_specs(arch: Architecture, i: int) -> list[ParamSpec]:
    """Parameters of block ``i`` in the order they sit in the block's flat buffer."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
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


# ------------------------------------------------------------------------------------------ LoRA


def lora_module_path(i: int, module: str) -> str:
    """``model.layers.{i}.self_attn.q_proj`` / ``model.layers.{i}.mlp.up_proj``: HF's module names."""
    return f"model.layers.{i}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"


def linear_dims(arch: Architecture, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a block's projection."""
    h, inter, q, kv = arch.hidden_size, arch.intermediate_size, arch.num_attention_heads * arch.head_dim, \
        arch.kv_heads * arch.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[module]


def lora_block_specs(arch: Architecture, lora: LoraConfig, i: int) -> list[ParamSpec]:
    """Block ``i``'s adapters in flat-buffer order: per targeted projection ``lora_A`` (rank x in)
    then ``lora_B`` (out x rank); the update is ``scaling * B @ A``."""
    specs = []
    for m in lora.modules:
        fan_in, fan_out = linear_dims(arch, m)
        p = lora_module_path(i, m)
        specs += [ParamSpec(f"{p}.lora_A", (lora.rank, fan_in), f"block.{i}", True),
                  ParamSpec(f"{p}.lora_B", (fan_out, lora.rank), f"block.{i}", True)]
    return specs


def optimizer_groups(config: AprConfig) -> list[tuple[str, list[ParamSpec]]]:
    """The trained parameters by optimizer group, in buffer-plan order. Full training: the
    embedding, each block, the final norm + head. LoRA: each block's adapters (the rest is frozen)."""
    arch, lora = config.model.architecture, config.model.lora
    if lora is not None:
        return [(f"block.{i}", lora_block_specs(arch, lora, i)) for i in range(arch.num_hidden_layers)]
    groups = [("embed", embed_param_specs(arch, config.optimizer.decay_embeddings))]
    groups += [(f"block.{i}", block_param_specs(arch, i)) for i in range(arch.num_hidden_layers)]
    return groups + [("head", head_param_specs(arch))]


def group_sizes(config: AprConfig) -> list[tuple[str, int]]:
    """``(group, numel)`` of ``optimizer_groups`` without building each block's specs (one rank's
    shard of the whole: ``_group_shards`` at one rank), so the plan's depth searches over thousands
    of layers (``plan/memory.py``) stay cheap."""
    return list(_group_shards(config, 1).items())


def trainable_param_count(config: AprConfig) -> int:
    """Parameters the optimizer updates: every one, or with LoRA ``layers x sum(rank x (in + out))``."""
    return sum(p.numel for _, specs in optimizer_groups(config) for p in specs)


def block_numel(arch: Architecture) -> int:
    return sum(p.numel for p in block_param_specs(arch, 0))


def param_count(arch: Architecture) -> int:
    """Exact number of trainable parameters (tied embeddings counted once): the sum over
    ``param_specs``, with every block the same size (no specs built per block)."""
    return (sum(p.numel for p in embed_param_specs(arch)) + arch.num_hidden_layers * block_numel(arch)
            + sum(p.numel for p in head_param_specs(arch)))


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


def compute_dtype_name(precision: MixedPrecision | str) -> str:
    """The compute dtype's name ("bfloat16") for ``training.mixed_precision`` ("bf16");
    ``apr.train.precision.torch_dtype`` turns it into the torch dtype."""
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[str(precision)]


def uses_compute_copy(config: AprConfig, execution: Execution | None = None) -> bool:
    """Whether the interleaved engine keeps a bf16/fp16 compute copy of each block's weights, written
    by AdamW (``param_copy``) so that no forward re-casts the fp32 masters (docs/design.md,
    "The engines"). Not under LoRA (the trunk is the model's own frozen tensors) nor with compiled
    blocks (the compiled graph does its own casts)."""

    tr = config.training
    compiled = (execution or from_config(config)).compile
    return (gradient_source(config) == "interleaved" and config.model.lora is None and not compiled
            and compute_dtype_name(tr.mixed_precision) != "float32")


def sharded(config: AprConfig) -> bool:
    """``training.sharding`` in effect: FSDP2 over more than one rank (either engine)."""
    tr = config.training
    return str(tr.sharding) != "none" and tr.world_size > 1


def _group_shards(config: AprConfig, w: int) -> dict[str, int]:
    """Each optimizer group's largest shard over ``w`` ranks (first dimension split, rounded up);
    every block's is the same, so one block's specs are built (see ``group_sizes``)."""
    arch, lora = config.model.architecture, config.model.lora

    def shard_of(specs: list[ParamSpec]) -> int:
        return sum(-(-p.shape[0] // w) * (p.numel // p.shape[0]) for p in specs)

    per_block = shard_of(lora_block_specs(arch, lora, 0) if lora is not None else block_param_specs(arch, 0))
    blocks = {f"block.{i}": per_block for i in range(arch.num_hidden_layers)}
    if lora is not None:
        return blocks
    return {"embed": shard_of(embed_param_specs(arch)), **blocks, "head": shard_of(head_param_specs(arch))}


def _sharded_buffers(config: AprConfig, groups: list[tuple[str, int]], execution: Execution | None) -> list[Buffer]:
    """One rank's buffers under FSDP2 (docs/distributed.md, "Sharding"): every parameter is split
    along its first dimension into ``world_size`` shards (rank 0 holds ``ceil(rows / world_size)``
    rows, the largest), and so are its AdamW moments and its reduced gradient. ``full`` gathers a
    block's weights for its forward and again for its backward (the current block and the
    prefetched next one); ``shard_grad_op`` keeps every gathered block from its forward to its
    backward. A block's unsharded gradient exists until it is reduce-scattered. The standard
    engine (and the interleaved one with kept gradients) holds every gradient shard until the
    step's update; the interleaved walk runs AdamW on each group's shard as it arrives and drops it
    (one group's shard at a time, ``grad_shard``), and keeps its blocks' inputs as it does unsharded."""
    tr = config.training
    # ranks sharing a shard: hybrid shards within a node (at least one rank, even for an uneven layout
    # the plan reports as an error)
    w = max(1, tr.world_size // tr.nodes) if str(tr.sharding) == "hybrid" else tr.world_size
    arch = config.model.architecture
    shard = _group_shards(config, w)
    bufs = [Buffer(f"{name}.flat_params", "weights", (shard[name],), "float32") for name, _ in groups]
    for name, _ in groups:
        bufs.append(Buffer(f"{name}.adam_m", "adamw_m", (shard[name],), "float32"))
        bufs.append(Buffer(f"{name}.adam_v", "adamw_v", (shard[name],), "float32"))
    interleaved = gradient_source(config) == "interleaved"
    if not interleaved or step_strategy(config, execution).keeps_all_grads:
        bufs += [Buffer(f"{name}.grad", "gradients", (shard[name],), "float32") for name, _ in groups]
    else:  # AdamW on each group's gradient shard as it arrives, then the shard is dropped
        bufs.append(Buffer("grad_shard", "gradients", (max(shard.values()),), "float32"))
    largest = max(n for _, n in groups)
    gathered = sum(n for _, n in groups) if str(tr.sharding) == "shard_grad_op" else 2 * largest
    bufs.append(Buffer("gathered_weights", "weights", (gathered,), "float32"))
    bufs.append(Buffer("unsharded_grad", "gradients", (largest,), "float32"))
    b, s, h, v = config.data.batch_size, config.data.seq_len, arch.hidden_size, arch.vocab_size
    bufs.append(Buffer("head_saved_grad", "gradients", (v, h), "float32"))
    if interleaved:  # recomputed blocks' inputs (saved by activation checkpointing), the residual gradient
        cdt = compute_dtype_name(tr.mixed_precision)
        recomputed = (execution or from_config(config)).recomputed_blocks
        if recomputed:
            bufs.append(Buffer("block_inputs", "activation_checkpoints", (recomputed, b, s, h), cdt))
        bufs.append(Buffer("residual_grad", "activation_checkpoints", (2, b, s, h), cdt))
    return bufs + _step_buffers(config, b, s, h, v)


def buffer_plan(config: AprConfig, execution: Execution | None = None) -> list[Buffer]:
    """The trainer's persistent device buffers. The interleaved engine allocates its weights, AdamW
    state and gradient buffers from this list by name (``apr.train.engine.allocate_buffers``); the
    standard engine's parameters, ``torch.optim.AdamW`` state and autograd gradients are allocated by
    torch at the same sizes, so these rows model them. The other rows (activation checkpoints, logits
    chunk, head hidden states, token ids, the standard engine's saved head gradient) are tensors the
    engines create during a step, listed at the shapes they create them. ``execution``: the
    resolved policy (apr/steps/execution.py); default: the config's, ``auto`` as if memory were
    unlimited.

    Weights, optimizer state and gradient buffers are float32 (master weights); activation
    checkpoints are kept in the compute dtype. Activations inside one block and allocator slack are
    modelled separately (apr/plan/memory.py), calibrated against measured peaks.
    """
    arch = config.model.architecture
    tr = config.training
    b, s, h, v = config.data.batch_size, config.data.seq_len, arch.hidden_size, arch.vocab_size
    cdt = compute_dtype_name(tr.mixed_precision)
    interleaved = gradient_source(config) == "interleaved"
    bufs: list[Buffer] = []

    lora = config.model.lora
    groups = group_sizes(config)
    if lora is not None:
        # the frozen base: the model's own tensors (no gradient, no moments), adapters in flat buffers;
        # with a bf16 trunk the blocks' projections are stored in bf16
        projections = arch.num_hidden_layers * sum(p.numel for p in block_param_specs(arch, 0) if p.decay)
        if str(lora.trunk_dtype) == "bf16":
            bufs.append(Buffer("frozen_base", "frozen_weights", (param_count(arch) - projections,), "float32"))
            bufs.append(Buffer("frozen_projections", "frozen_weights", (projections,), "bfloat16"))
        else:
            bufs.append(Buffer("frozen_base", "frozen_weights", (param_count(arch),), "float32"))
    if sharded(config):
        return bufs + _sharded_buffers(config, groups, execution)
    for name, numel in groups:
        bufs.append(Buffer(f"{name}.flat_params", "adapters" if lora else "weights", (numel,), "float32"))
    if uses_compute_copy(config, execution):  # each block's weights in the compute dtype, kept by AdamW
        for name, numel in groups:
            if name.startswith("block."):
                bufs.append(Buffer(f"{name}.compute", "compute_weights", (numel,), cdt))
    for name, numel in groups:
        bufs.append(Buffer(f"{name}.adam_m", "adamw_m", (numel,), "float32"))
        bufs.append(Buffer(f"{name}.adam_v", "adamw_v", (numel,), "float32"))

    # Gradients (apr.steps.strategy, under the execution policy's ``gradients``): when every
    # group's gradient is kept for the whole step (the standard engine, gradient accumulation,
    # ``kept``), the interleaved engine also has a scratch of the embedding's size where a later
    # micro-batch's LM-head and embedding gradients (or a tied embedding's lookup gradient) are
    # formed before they are added (the same rounding as autograd's accumulation). Otherwise one
    # shared workspace sized for the largest group serves the head, each block and the embedding
    # in turn; a tied embedding keeps its own buffer (the LM head's gradient, first in the walk, and
    # the embedding's, last, both add into it) and forms its lookup gradient in the workspace.
    if step_strategy(config, execution).keeps_all_grads:
        for name, numel in groups:
            bufs.append(Buffer(f"{name}.grad", "gradients", (numel,), "float32"))
        if interleaved and lora is None and (tr.gradient_accumulation > 1 or arch.tie_word_embeddings):
            bufs.append(Buffer("grad_scratch", "gradients", (v * h,), "float32"))
    else:
        if arch.tie_word_embeddings and lora is None:
            bufs.append(Buffer("embed.grad", "gradients", (v * h,), "float32"))
        bufs.append(Buffer("grad_workspace", "gradients", (max(n for _, n in groups),), "float32"))
        if tr.world_size > 1:
            # data parallel: one group's gradient is all-reduced while the next one's backward fills this
            bufs.append(Buffer("grad_workspace_1", "gradients", (max(n for _, n in groups),), "float32"))
    if not interleaved and lora is None:
        # the chunked LM-head loss holds its weight gradient from the forward until backward
        bufs.append(Buffer("head_saved_grad", "gradients", (v, h), "float32"))

    if interleaved:
        bufs.append(Buffer("block_inputs", "activation_checkpoints", (arch.num_hidden_layers + 1, b, s, h), cdt))
        # the gradient flowing down the residual stream: a block's output grad and its input grad
        bufs.append(Buffer("residual_grad", "activation_checkpoints", (2, b, s, h), cdt))
    return bufs + _step_buffers(config, b, s, h, v)


def _step_buffers(config: AprConfig, b: int, s: int, h: int, v: int) -> list[Buffer]:
    """The tensors every step creates outside the blocks: the loss's logits chunk, the head's
    hidden states and the token ids."""
    cdt = compute_dtype_name(config.training.mixed_precision)
    chunk = min(config.training.loss_chunk_size, s)
    bufs = [Buffer("logits_chunk", "logits_chunk", (b, chunk, v), "float32")]  # d_logits in place
    if cdt != "float32":
        bufs.append(Buffer("logits_chunk_compute", "logits_chunk", (b, chunk, v), cdt))
    # the final-normed hidden states (float32: the norm weight is float32) and their gradient
    bufs.append(Buffer("head_hidden", "logits_chunk", (2, b, s, h), "float32"))
    bufs.append(Buffer("token_ids", "inputs", (b, s + 1), "int64"))
    return bufs
