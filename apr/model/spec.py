"""The model's shapes and what follows from them, without torch: parameter names and counts,
optimizer groups and their shards, FLOPs per token. One source of truth for `apr train plan` and
`apr train apply`; the buffers the trainer allocates from these shapes are `apr/memory/buffers.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from apr.config.schema import AprConfig, Architecture, LoraConfig
from apr.steps import stacking

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


@dataclass(frozen=True)
class ParamSpec:
    name: str  # Hugging Face Llama name, e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    group: str  # "embed", "block.{i}", "head"
    decay: bool  # weight decay applies (matrices yes, norms no)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def qkv_bias(arch: Architecture) -> bool:
    """Qwen2's query, key and value projections carry biases (no other family's projections do)."""
    return arch.family == "qwen2"


def mla_param_specs(arch: Architecture, i: int) -> list[ParamSpec]:
    """Block ``i``'s multi-head latent attention (apr/model/mla.py; transformers' DeepseekV3 names):
    the query projection (or its latent, norm and expansion), the key/value latent with the shared
    RoPE key, its norm, its per-head expansion (position-free keys and values) and the output."""
    m, h, nq, hd = arch.mla, arch.hidden_size, arch.num_attention_heads, arch.head_dim
    p, g = f"model.layers.{i}.self_attn.", f"block.{i}"
    nope = hd - m.qk_rope_head_dim
    q = ([ParamSpec(p + "q_proj.weight", (nq * hd, h), g, True)] if m.q_lora_rank is None else
         [ParamSpec(p + "q_a_proj.weight", (m.q_lora_rank, h), g, True),
          ParamSpec(p + "q_a_layernorm.weight", (m.q_lora_rank,), g, False),
          ParamSpec(p + "q_b_proj.weight", (nq * hd, m.q_lora_rank), g, True)])
    return [*q,
            ParamSpec(p + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), g, True),
            ParamSpec(p + "kv_a_layernorm.weight", (m.kv_lora_rank,), g, False),
            ParamSpec(p + "kv_b_proj.weight", (nq * (nope + hd), m.kv_lora_rank), g, True),
            ParamSpec(p + "o_proj.weight", (h, nq * hd), g, True)]


def block_param_specs(arch: Architecture, i: int) -> list[ParamSpec]:
    """Parameters of block ``i`` in the order they sit in the block's flat buffer (a bias, not
    decayed, right after its projection's weight)."""
    h, hd = arch.hidden_size, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.kv_heads
    p = f"model.layers.{i}."
    g = f"block.{i}"
    d = arch.decoupled_attention
    bias = qkv_bias(arch)
    if d is None:
        qk = [ParamSpec(p + "self_attn.q_proj.weight", (nq * hd, h), g, True),
              *([ParamSpec(p + "self_attn.q_proj.bias", (nq * hd,), g, False)] if bias else []),
              ParamSpec(p + "self_attn.k_proj.weight", (nkv * hd, h), g, True),
              *([ParamSpec(p + "self_attn.k_proj.bias", (nkv * hd,), g, False)] if bias else [])]
    else:  # decoupled bottleneck attention (apr.model.llama.DecoupledAttention)
        qk = [ParamSpec(p + "self_attn.q_sem_proj.weight", (nq * d.sem_dim, h), g, True),
              ParamSpec(p + "self_attn.k_sem_proj.weight", (nkv * d.sem_dim, h), g, True),
              ParamSpec(p + "self_attn.q_geo_proj.weight", (nq * d.geo_dim, h), g, True),
              ParamSpec(p + "self_attn.k_geo_proj.weight", (nkv * d.geo_dim, h), g, True)]
    attention = mla_param_specs(arch, i) if arch.mla is not None else [  # latent attention: apr/model/mla.py
        *qk,
        ParamSpec(p + "self_attn.v_proj.weight", (nkv * hd, h), g, True),
        *([ParamSpec(p + "self_attn.v_proj.bias", (nkv * hd,), g, False)] if bias else []),
        ParamSpec(p + "self_attn.o_proj.weight", (h, nq * hd), g, True)]
    return [
        ParamSpec(p + "input_layernorm.weight", (h,), g, False),
        *attention,
        ParamSpec(p + "post_attention_layernorm.weight", (h,), g, False),
        *mlp_param_specs(arch, i),
    ]


def expert_intermediate_size(arch: Architecture) -> int:
    """SwiGLU width of one expert (``moe.expert_intermediate_size``, default the dense MLP's)."""
    return arch.moe.expert_intermediate_size or arch.intermediate_size


def mlp_param_specs(arch: Architecture, i: int) -> list[ParamSpec]:
    """Block ``i``'s MLP: the dense SwiGLU, or under ``moe`` the router and the experts' two 3-D
    tensors (Mixtral's names in transformers 5; apr/model/moe.py)."""
    h, p, g = arch.hidden_size, f"model.layers.{i}.mlp.", f"block.{i}"
    if arch.moe is None:
        inter = arch.intermediate_size
        return [ParamSpec(p + "gate_proj.weight", (inter, h), g, True),
                ParamSpec(p + "up_proj.weight", (inter, h), g, True),
                ParamSpec(p + "down_proj.weight", (h, inter), g, True)]
    e, inter = arch.moe.num_experts, expert_intermediate_size(arch)
    return [ParamSpec(p + "gate.weight", (e, h), g, True),
            ParamSpec(p + "experts.gate_up_proj", (e, 2 * inter, h), g, True),
            ParamSpec(p + "experts.down_proj", (e, h, inter), g, True)]


def mlp_token_width(arch: Architecture) -> int:
    """The SwiGLU width one token's MLP activations span: the dense MLP's, or its top_k experts' together."""
    return arch.intermediate_size if arch.moe is None else arch.moe.top_k * expert_intermediate_size(arch)


def routed_rows(arch: Architecture) -> int:
    """Copies of a token's hidden row a block's MLP routes (its top_k experts' inputs); 0 when dense."""
    return 0 if arch.moe is None else arch.moe.top_k


def inactive_block_numel(arch: Architecture) -> int:
    """A block's parameters a token does not use: the experts it is not routed to (0 when dense)."""
    if arch.moe is None:
        return 0
    return (arch.moe.num_experts - arch.moe.top_k) * 3 * expert_intermediate_size(arch) * arch.hidden_size


def embed_param_specs(arch: Architecture, decay_embeddings: bool = False) -> list[ParamSpec]:
    """The token embedding, and with ``time`` the time embedding (in the embedding's group)."""
    return [ParamSpec("model.embed_tokens.weight", (arch.vocab_size, arch.hidden_size), "embed", decay_embeddings),
            *time_param_specs(arch, decay_embeddings)]


def time_param_specs(arch: Architecture, decay_embeddings: bool = False) -> list[ParamSpec]:
    """``model.architecture.time`` (apr/model/time.py): the learned encoding's table (an embedding)
    and the projection to ``hidden_size``; none without time conditioning."""
    t = arch.time
    if t is None:
        return []
    table = [ParamSpec("model.time_embedding.table.weight", (t.num_time_steps, t.embedding_dim), "embed",
                       decay_embeddings)] if str(t.encoding) == "learned" else []
    return [*table, ParamSpec("model.time_embedding.proj.weight", (arch.hidden_size, t.embedding_dim), "embed", True)]


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


def progressive_suffix(stage: int) -> str:
    """The name suffix of the progressive adapter stage ``stage``'s grow added (``lora_A_s2``)."""
    return f"_s{stage}"


def trunk_adapter_specs(config: AprConfig, i: int) -> list[ParamSpec]:
    """Trunk block ``i``'s adapters in flat order: its own (``block_adapters``: the rank of the stage
    that added it), then per stage that gave it a progressive adapter (``progressive_lora``),
    ``lora_A_s<k>``/``lora_B_s<k>`` of that rank."""
    arch, adapters = config.model.architecture, stacking.block_adapters(config, i)
    specs = lora_block_specs(arch, adapters, i)
    prog = config.model.stacking.progressive_lora
    for k in stacking.progressive_stages(config).get(i, ()):
        for m in adapters.modules:
            fan_in, fan_out = linear_dims(arch, m)
            p, sfx = lora_module_path(i, m), progressive_suffix(k)
            specs += [ParamSpec(f"{p}.lora_A{sfx}", (prog.rank, fan_in), f"block.{i}", True),
                      ParamSpec(f"{p}.lora_B{sfx}", (fan_out, prog.rank), f"block.{i}", True)]
    return specs


def optimizer_groups(config: AprConfig) -> list[tuple[str, list[ParamSpec]]]:
    """The trained parameters by optimizer group, in buffer-plan order. Full training: the
    embedding, each block, the final norm + head. LoRA: each block's adapters (the rest is frozen).
    A transformed stacking trunk (docs/design.md, "StackWise progressive stacks"): its blocks'
    adapters, or no group for a trunk block without adapters."""
    arch, lora = config.model.architecture, config.model.lora
    if lora is not None:
        return [(f"block.{i}", lora_block_specs(arch, lora, i)) for i in range(arch.num_hidden_layers)]
    trunk, adapters = stacking.trunk_storage(config), stacking.trunk_adapters(config)
    groups = [("embed", embed_param_specs(arch, config.optimizer.decay_embeddings))]
    if stacking.embedding_frozen(config):  # part of the trunk: no group, no moments
        groups = []
    for i in range(arch.num_hidden_layers):
        if i not in trunk:
            groups.append((f"block.{i}", block_param_specs(arch, i)))
        elif adapters is not None:
            groups.append((f"block.{i}", trunk_adapter_specs(config, i)))
    return groups + [("head", head_param_specs(arch))]


# ------------------------------------------------------------------------------- the stacking trunk

NF4_BLOCK = 64  # torchao's NF4 block: 64 weights share one absmax scaler
NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def nf4_scaler_block(numel: int) -> int:
    """The scaler block for double quantization: torchao's 256, or the largest power of two that
    divides the weight's number of 64-blocks (small test models)."""
    n = numel // NF4_BLOCK
    return next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if n % b == 0)


def nf4_part_shapes(numel: int) -> dict[str, tuple[int, ...]]:
    """A weight's NF4 state as torchao holds it: two 4-bit codes per byte, one int8 scaler per
    64-block, a float32 factor per scaler block and the scalers' mean."""
    blocks = numel // NF4_BLOCK
    return {"quantized_data": (numel // 2,), "quantized_scalers": (blocks,),
            "quantization_factor": (blocks // nf4_scaler_block(numel),), "scaler_mean": ()}


def trunk_specs(config: AprConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The frozen trunk's tensors as checkpoints hold them (float32, no moments): each trunk
    block's norms and projections; an NF4 projection as its torchao parts (``<name>.nf4.<part>``),
    kept exactly so that a resumed run quantizes nothing again."""
    arch = config.model.architecture
    out = [(p.name, p.shape) for p in embed_param_specs(arch)] if stacking.embedding_frozen(config) else []
    for i, storage in stacking.trunk_storage(config).items():
        for p in block_param_specs(arch, i):
            if storage == "nf4" and p.decay:
                out += [(f"{p.name}.nf4.{part}", shape) for part, shape in nf4_part_shapes(p.numel).items()]
            else:
                out.append((p.name, p.shape))
    return out


STORAGE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}


def stored_weight_bytes(numel: int, storage: str) -> int:
    """Bytes of one projection weight in its trunk storage (NF4: half a byte per weight plus its
    scalers)."""
    if storage == "nf4":
        parts = nf4_part_shapes(numel)
        return numel // 2 + parts["quantized_scalers"][0] + 4 * parts["quantization_factor"][0] + 4
    return int(numel * STORAGE_BYTES[storage])


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


def active_param_count(arch: Architecture) -> int:
    """Parameters one token uses: all of them, less under ``moe`` the experts it is not routed to."""
    return param_count(arch) - arch.num_hidden_layers * inactive_block_numel(arch)


def non_embedding_param_count(arch: Architecture) -> int:
    """Parameters that take part in matmuls per token: blocks (under ``moe`` the router and the
    ``top_k`` experts a token is routed to), final norm and LM head."""
    head = arch.vocab_size * arch.hidden_size  # the LM head matmul runs even when tied
    return arch.num_hidden_layers * (block_numel(arch) - inactive_block_numel(arch)) + arch.hidden_size + head


def flops_per_token(arch: Architecture, seq_len: int) -> int:
    """Training FLOPs per token: 6N (forward + backward of the matmuls) plus the attention term
    12 * layers * hidden * seq_len (PaLM, appendix B). Recompute in the interleaved engine is not
    counted: this is the model-FLOPs figure MFU is quoted against."""
    n = non_embedding_param_count(arch)
    attended = min(seq_len, arch.sliding_window or seq_len)  # a sliding window caps the keys per query
    return 6 * n + 12 * arch.num_hidden_layers * arch.hidden_size * attended + time_flops_per_token(arch, seq_len)


def time_flops_per_token(arch: Architecture, seq_len: int) -> int:
    """``time``'s projection runs once per sequence: 6 x its weights over the sequence's tokens (rounded up)."""
    if arch.time is None:
        return 0
    return -(-6 * arch.time.embedding_dim * arch.hidden_size // seq_len)


def kv_cache_bytes_per_token(arch: Architecture, dtype_bytes: int = 2) -> int:
    """Bytes the key/value cache of generation holds per token of context: keys and values of every
    layer's key/value heads (what grouped-query attention shrinks; decoupled attention narrows the
    keys to ``sem_dim + geo_dim``; latent attention holds each layer's latent and shared RoPE key)."""
    if arch.mla is not None:
        return arch.num_hidden_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * dtype_bytes
    d = arch.decoupled_attention
    key = arch.head_dim if d is None else d.sem_dim + d.geo_dim
    return arch.num_hidden_layers * arch.kv_heads * (key + arch.head_dim) * dtype_bytes


def rope_dim(arch: Architecture) -> int:
    """Width RoPE rotates per head: the head, decoupled attention's geometric part or latent
    attention's RoPE part."""
    if arch.mla is not None:
        return arch.mla.qk_rope_head_dim
    return arch.head_dim if arch.decoupled_attention is None else arch.decoupled_attention.geo_dim


def rope_base(arch: Architecture) -> float:
    """RoPE's base for ``rope_dim``. Decoupled attention's geometric part keeps the teacher head's
    ``geo_dim / 2`` fastest frequencies: pair ``j`` of ``geo_dim`` turns at ``base^(-2j / geo_dim)``,
    equal to the head's ``theta^(-2j / head_dim)`` when ``base = theta^(geo_dim / head_dim)``."""
    d = arch.decoupled_attention
    return arch.rope_theta if d is None else arch.rope_theta ** (d.geo_dim / arch.head_dim)


def student_init_problems(student: Architecture, teacher: Architecture) -> list[tuple[str, str, str, str]]:
    """Why a student block cannot start from a teacher block: ``(key, message, expected, got)`` per
    reason; the plan's check and ``apr.model.surgery``'s.
    See docs/design.md, "Upcycling into a new architecture"."""
    out = []
    if student.num_attention_heads != teacher.num_attention_heads:
        out.append(("num_attention_heads", f"the student has {student.num_attention_heads} query heads, the teacher "
                    f"{teacher.num_attention_heads}: each student query head starts from the teacher's head",
                    str(teacher.num_attention_heads), str(student.num_attention_heads)))
    elif teacher.kv_heads % student.kv_heads:
        out.append(("num_key_value_heads", f"the student's {student.kv_heads} key/value heads do not divide the "
                    f"teacher's {teacher.kv_heads}: each student head averages a whole group of teacher heads",
                    f"a divisor of {teacher.kv_heads}", str(student.kv_heads)))
    if teacher.decoupled_attention is not None and student.decoupled_attention != teacher.decoupled_attention:
        out.append(("decoupled_attention", "the teacher has decoupled attention: a student starts from it only "
                    "with the same decoupled_attention", str(teacher.decoupled_attention), str(
                        student.decoupled_attention)))
    if student.hidden_size != teacher.hidden_size:  # a narrower student: design section 30
        if student.hidden_size > teacher.hidden_size:
            out.append(("hidden_size", f"the student is {student.hidden_size} wide, wider than the teacher's "
                        f"{teacher.hidden_size}: a student starts from the teacher's top {student.hidden_size} "
                        "embedding directions", f"at most {teacher.hidden_size}", str(student.hidden_size)))
        elif student.num_attention_heads == teacher.num_attention_heads and (
                teacher.head_dim % student.head_dim or student.head_dim % 2):
            out.append(("hidden_size", f"the student's head_dim {student.head_dim} (hidden_size / heads) must be "
                        f"even and divide the teacher's {teacher.head_dim}: each student head keeps every k-th RoPE "
                        "pair of its teacher head", f"hidden_size / {student.num_attention_heads} an even divisor "
                        f"of {teacher.head_dim}", str(student.hidden_size)))
        if student.decoupled_attention is not None or teacher.decoupled_attention is not None:
            out.append(("decoupled_attention", "a narrower student starts from the teacher only with standard "
                        "attention on both sides", "standard attention", str(student.decoupled_attention)))
    if qkv_bias(teacher) or qkv_bias(student):  # apr.model.surgery copies weight matrices only
        out.append(("family", "a student starts from its teacher's projection weights, and apr carries no q/k/v "
                    "biases into it: a qwen2 teacher or student cannot use init_from_teacher", "llama or mistral on "
                    "both sides", f"teacher {teacher.family.value}, student {student.family.value}"))
    if student.rope_scaling != teacher.rope_scaling:
        out.append(("rope_scaling", "the student's queries and keys start from the teacher's, which turn by the "
                    "teacher's RoPE: the student needs the same rope_scaling", str(teacher.rope_scaling),
                    str(student.rope_scaling)))
    elif teacher.rope_scaling is not None and student.hidden_size != teacher.hidden_size:
        out.append(("rope_scaling", "a narrower student keeps every k-th RoPE pair of its teacher's heads, which a "
                    "scaled RoPE does not preserve", "a teacher without rope_scaling", str(teacher.rope_scaling)))
    if student.intermediate_size > teacher.intermediate_size:
        out.append(("intermediate_size", f"the student's MLP is {student.intermediate_size} wide, wider than the "
                    f"teacher's {teacher.intermediate_size}: the student keeps a subset of the teacher's neurons",
                    f"at most {teacher.intermediate_size}", str(student.intermediate_size)))
    return out


def _group_shards(config: AprConfig, w: int) -> dict[str, int]:
    """Each optimizer group's largest shard over ``w`` ranks (first dimension split, rounded up);
    every block's is the same, so one block's specs are built (see ``group_sizes``)."""
    arch, lora = config.model.architecture, config.model.lora

    def shard_of(specs: list[ParamSpec]) -> int:
        return sum(-(-p.shape[0] // w) * (p.numel // p.shape[0]) for p in specs)

    if lora is None and stacking.trunk_storage(config):  # trunk blocks: adapters only, or no group
        return {name: shard_of(specs) for name, specs in optimizer_groups(config)}
    per_block = shard_of(lora_block_specs(arch, lora, 0) if lora is not None else block_param_specs(arch, 0))
    blocks = {f"block.{i}": per_block for i in range(arch.num_hidden_layers)}
    if lora is not None:
        return blocks
    return {"embed": shard_of(embed_param_specs(arch)), **blocks, "head": shard_of(head_param_specs(arch))}


def stack_bytes(config: AprConfig) -> list[dict]:
    """Per stack (the blocks one stage added) of the config's last stage: its blocks, where they
    sit, how their projections are stored and the bytes of their weights and adapters (the plan's
    bytes per stack). Without stacking: one stack of every block in float32."""
    arch, st = config.model.architecture, config.model.stacking
    k = len(st.stages) - 1 if st is not None else 0
    origins = stacking.block_origins(config)
    trunk, adapters = stacking.trunk_storage(config), stacking.trunk_adapters(config)
    block = block_param_specs(arch, 0)
    out = []
    for j in range(k + 1):
        blocks = [b for b, o in enumerate(origins) if o == j]
        storage = trunk.get(blocks[0], "fp32") if blocks else "fp32"
        per_block = sum(stored_weight_bytes(p.numel, storage) if p.decay else 4 * p.numel for p in block)
        in_trunk = bool(blocks) and blocks[0] in trunk
        adapter = sum(p.numel for p in trunk_adapter_specs(config, blocks[0])) if in_trunk and adapters else 0
        frozen = in_trunk or (j < k and str(st.earlier) == "freeze")
        out.append({"stack": j, "blocks": len(blocks), "first_block": blocks[0] if blocks else None,
                    "storage": storage, "trains": "adapters" if adapter else "frozen" if frozen else "all",
                    "weight_bytes": per_block * len(blocks), "adapter_params": adapter * len(blocks),
                    "adapters": 1 + len(stacking.progressive_stages(config).get(blocks[0], ())) if adapter else 0})
    return out
