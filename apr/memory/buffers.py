"""The buffer plan: the trainer's persistent device buffers, declared by the parts of the composed
engine that own them (docs/design.md, "The buffer plan" and "The composed engine").

Each gradient source declares its own buffers (``walk_buffers``: the flat-buffer walk, which
allocates its weights, AdamW state and gradient buffers from this list by name, see
``apr.train.build.allocate_buffers``; ``autograd_buffers``: plain autograd, whose parameters, torch
AdamW state and gradients torch allocates at these sizes; ``fsdp2_buffers``: either source under
FSDP2, one rank's shards); the LoRA transform declares the frozen base (``frozen_buffers``); every
step declares its loss chunk, hidden states and token ids (``step_buffers``). ``buffer_plan`` is
their sum for the composition a config resolves to: the plan's memory table sums it, the engine
classes name their declaration (``Engine.declares``), and tests hold the two together.

Weights, optimizer state and gradient buffers are float32 (master weights), or bfloat16 with
``training.state_dtype: bf16`` (the walk's weights, moments and gradients: ``state_dtype_name``);
activation checkpoints are kept in the compute dtype. Activations inside one block and allocator slack are modelled
separately (apr/memory/activations.py, apr/memory/table.py), calibrated against measured peaks.
Torch-free: ``apr train validate`` and the plan load it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from apr.config.schema import AprConfig, MixedPrecision
from apr.model.spec import (
    DTYPE_BYTES,
    _group_shards,
    block_param_specs,
    embed_param_specs,
    group_sizes,
    head_param_specs,
    optimizer_groups,
    param_count,
    stored_weight_bytes,
)
from apr.steps.execution import Execution, from_config, gradient_source
from apr.steps.stacking import trunk_storage
from apr.steps.strategy import step_strategy


@dataclass(frozen=True)
class Buffer:
    """A named device allocation of the trainer."""

    name: str
    component: str  # row of the plan's memory table
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def compute_dtype_name(precision: MixedPrecision | str) -> str:
    """The compute dtype's name ("bfloat16") for ``training.mixed_precision`` ("bf16");
    ``apr.train.precision.torch_dtype`` turns it into the torch dtype."""
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[str(precision)]


def state_dtype_name(config: AprConfig) -> str:
    """The dtype the walk stores its weights, AdamW moments and gradients in (``training.state_dtype``):
    "float32", or "bfloat16" (the weights are then the compute copy; a parameter's gradient has its
    dtype, so the gradient buffers are bf16 too)."""
    return "bfloat16" if str(config.training.state_dtype) == "bf16" else "float32"


def uses_compute_copy(config: AprConfig, execution: Execution | None = None) -> bool:
    """Whether the interleaved engine keeps a bf16/fp16 compute copy of each block's weights, written
    by AdamW (``param_copy``) so that no forward re-casts the fp32 masters (docs/design.md,
    "The engines"). Not under LoRA (the trunk is the model's own frozen tensors) nor with compiled
    blocks (the compiled graph does its own casts)."""
    tr = config.training
    compiled = (execution or from_config(config)).compile
    return (gradient_source(config) == "interleaved" and config.model.lora is None and not compiled
            and compute_dtype_name(tr.mixed_precision) != "float32" and state_dtype_name(config) == "float32")


def sharded(config: AprConfig) -> bool:
    """``training.sharding`` in effect: FSDP2 over more than one rank (either engine)."""
    tr = config.training
    return str(tr.sharding) != "none" and tr.world_size > 1


def _shard_ranks(config: AprConfig) -> int:
    """Ranks sharing a shard: hybrid shards within a node (at least one rank, even for an uneven
    layout the plan reports as an error); one without sharding."""
    tr = config.training
    if not sharded(config):
        return 1
    return max(1, tr.world_size // tr.nodes) if str(tr.sharding) == "hybrid" else tr.world_size


# ------------------------------------------------------------------------------- the LoRA transform


def frozen_buffers(config: AprConfig) -> list[Buffer]:
    """LoRA's frozen base (the model's own tensors: no gradient, no moments); with a bf16 trunk the
    blocks' projections are stored in bf16, with an NF4 one as the bytes of their codes and
    scalers. Under FSDP2 each rank holds its rows of every tensor."""
    lora = config.model.lora
    if lora is None:
        return _trunk_buffers(config)
    arch = config.model.architecture
    w = _shard_ranks(config)
    if str(lora.trunk_dtype) == "nf4":  # QLoRA: codes and scalers of each projection (no sharding: validate)
        block = [p for p in block_param_specs(arch, 0) if p.decay]
        projections = arch.num_hidden_layers * sum(p.numel for p in block)
        size = arch.num_hidden_layers * sum(stored_weight_bytes(p.numel, "nf4") for p in block)
        return [Buffer("frozen_base", "frozen_weights", (param_count(arch) - projections,), "float32"),
                Buffer("frozen_projections", "frozen_weights", (size,), "uint8")]
    if w == 1:
        projections = arch.num_hidden_layers * sum(p.numel for p in block_param_specs(arch, 0) if p.decay)
        rest = param_count(arch) - projections
    else:  # each tensor's largest shard: ceil(rows / w) rows
        def shard(specs) -> int:
            return sum(-(-p.shape[0] // w) * (p.numel // p.shape[0]) for p in specs)

        block = block_param_specs(arch, 0)
        projections = arch.num_hidden_layers * shard([p for p in block if p.decay])
        rest = (arch.num_hidden_layers * shard([p for p in block if not p.decay])
                + shard(embed_param_specs(arch)) + shard(head_param_specs(arch)))
    if str(lora.trunk_dtype) == "bf16":
        return [Buffer("frozen_base", "frozen_weights", (rest,), "float32"),
                Buffer("frozen_projections", "frozen_weights", (projections,), "bfloat16")]
    return [Buffer("frozen_base", "frozen_weights", (rest + projections,), "float32")]


def _trunk_buffers(config: AprConfig) -> list[Buffer]:
    """A stacking trunk outside the optimizer groups (docs/design.md, "StackWise progressive
    stacks"): its blocks' weights in their storage, NF4 as the bytes of its codes and scalers."""
    trunk = trunk_storage(config)
    if not trunk:
        return []
    dtypes = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    specs = block_param_specs(config.model.architecture, 0)
    norms = sum(p.numel for p in specs if not p.decay) * len(trunk)
    out = [Buffer("trunk.norms", "frozen_weights", (norms,), "float32")]
    for storage in sorted(set(trunk.values())):
        blocks = sum(1 for v in trunk.values() if v == storage)
        if storage == "nf4":
            size = blocks * sum(stored_weight_bytes(p.numel, "nf4") for p in specs if p.decay)
            out.append(Buffer("trunk.nf4", "frozen_weights", (size,), "uint8"))
        else:
            size = blocks * sum(p.numel for p in specs if p.decay)
            out.append(Buffer(f"trunk.{storage}", "frozen_weights", (size,), dtypes[storage]))
    return out


# ------------------------------------------------------------------------------- gradient sources


def _params_and_moments(config: AprConfig, groups: list[tuple[str, int]], execution: Execution | None) -> list[Buffer]:
    sdt = state_dtype_name(config)
    bufs = [Buffer(f"{name}.flat_params", "adapters" if config.model.lora else "weights", (numel,), sdt)
            for name, numel in groups]
    if uses_compute_copy(config, execution):  # each block's weights in the compute dtype, kept by AdamW
        cdt = compute_dtype_name(config.training.mixed_precision)
        bufs += [Buffer(f"{name}.compute", "compute_weights", (numel,), cdt) for name, numel in groups
                 if name.startswith("block.")]
    return bufs + _moment_buffers(config, groups)


def _moment_buffers(config: AprConfig, groups: list[tuple[str, int]]) -> list[Buffer]:
    """The updater's state per group, in the rows ``adamw_m`` / ``adamw_v`` (the checkpoint's
    ``optimizer.m.`` / ``optimizer.v.``): two fp32 moments (adamw, sgd, swats); Lion one, except on
    the walk and on FSDP2 shards, which allocate both by name (the second stays zero); Adafactor (autograd only) a
    statistic per row and one per column of each matrix, and a vector's whole second moment."""
    name_of = str(config.optimizer.name)
    walk = gradient_source(config) == "interleaved"
    if name_of == "adafactor" and not walk:
        rows, cols = _factored_numel(config)
        return [b for name, _ in groups for b in (Buffer(f"{name}.adafactor_row", "adamw_m", (rows[name],), "float32"),
                                                  Buffer(f"{name}.adafactor_col", "adamw_v", (cols[name],), "float32"))]
    sdt = state_dtype_name(config)
    out = [Buffer(f"{name}.adam_m", "adamw_m", (numel,), sdt) for name, numel in groups]
    if name_of != "lion" or walk or sharded(config):
        out += [Buffer(f"{name}.adam_v", "adamw_v", (numel,), sdt) for name, numel in groups]
    return out


def _factored_numel(config: AprConfig) -> tuple[dict[str, int], dict[str, int]]:
    """Per group, Adafactor's row-statistic and column-statistic elements (torch.optim.Adafactor: a
    matrix ``[..., R, C]`` keeps ``[..., R, 1]`` and ``[..., 1, C]``; a vector its own size, counted
    with the columns)."""
    rows: dict[str, int] = {}
    cols: dict[str, int] = {}
    for name, specs in optimizer_groups(config):
        rows[name] = sum(math.prod(p.shape[:-1]) for p in specs if len(p.shape) > 1)
        cols[name] = sum(math.prod(p.shape[:-2]) * p.shape[-1] if len(p.shape) > 1 else p.numel for p in specs)
    return rows, cols


def optimizer_state_details(config: AprConfig) -> dict[str, str]:
    """The memory table's words for the optimizer-state rows where they are not AdamW's moments."""
    name_of = str(config.optimizer.name)
    if name_of == "lion":
        return {"adamw_m": "Lion momentum (fp32)",
                "adamw_v": "unused by Lion: the flat-buffer walk and FSDP2 shards allocate a second "
                           "moment by name (zeros)"}
    if name_of == "adafactor":
        return {"adamw_m": "Adafactor row statistics (fp32, one per matrix row)",
                "adamw_v": "Adafactor column statistics and vectors' second moments (fp32)"}
    return {}


def state_dtype_details(config: AprConfig) -> dict[str, str]:
    """The memory table's words for the rows bf16 state changes (``training.state_dtype: bf16``)."""
    if state_dtype_name(config) == "float32":
        return {}
    return {"weights": "bf16 weights (2 B/param; also the compute copy), one flat buffer per block; each update "
                       "computed in fp32, stored with stochastic rounding",
            "adamw_m": "AdamW first moment (bf16, stochastic rounding)",
            "adamw_v": "AdamW second moment (bf16, stochastic rounding)",
            "gradients": "bf16 gradients (a parameter's gradient has its dtype): one workspace (the largest "
                         "group) or every group's gradient (kept)"}


def state_bytes_per_param(config: AprConfig) -> int:
    """Bytes a trained parameter's weights and optimizer moments take between steps: 12 in fp32, 6 in
    bf16 (training.state_dtype); the plan's finding shows it."""
    return 3 * DTYPE_BYTES[state_dtype_name(config)]


def walk_buffers(config: AprConfig, execution: Execution | None = None) -> list[Buffer]:
    """The flat-buffer walk (``InterleavedEngine``) in one process or under DDP.

    Gradients (apr.steps.strategy, under the execution policy's ``gradients``): when every group's
    gradient is kept for the whole step (gradient accumulation, ``kept``), each group has its own
    buffer, plus a scratch of the embedding's size where a later micro-batch's LM-head and embedding
    gradients (or a tied embedding's lookup gradient) are formed before they are added (the same
    rounding as autograd's accumulation). Otherwise one shared workspace sized for the largest group
    serves the head, each block and the embedding in turn; a tied embedding keeps its own buffer
    (the LM head's gradient, first in the walk, and the embedding's, last, both add into it)."""
    arch, tr, lora = config.model.architecture, config.training, config.model.lora
    b, s, h, v = config.data.batch_size, config.data.seq_len, arch.hidden_size, arch.vocab_size
    groups = group_sizes(config)
    bufs = _params_and_moments(config, groups, execution)
    gdt = state_dtype_name(config)  # a parameter's gradient has its dtype
    if step_strategy(config, execution).keeps_all_grads:
        bufs += [Buffer(f"{name}.grad", "gradients", (numel,), gdt) for name, numel in groups]
        if lora is None and (tr.gradient_accumulation > 1 or arch.tie_word_embeddings):
            bufs.append(Buffer("grad_scratch", "gradients", (v * h,), gdt))
    else:
        if arch.tie_word_embeddings and lora is None:
            bufs.append(Buffer("embed.grad", "gradients", (v * h,), gdt))
        bufs.append(Buffer("grad_workspace", "gradients", (max(n for _, n in groups),), gdt))
        if tr.world_size > 1:
            # data parallel: one group's gradient is all-reduced while the next one's backward fills this
            bufs.append(Buffer("grad_workspace_1", "gradients", (max(n for _, n in groups),), gdt))
    cdt = compute_dtype_name(tr.mixed_precision)
    bufs.append(Buffer("block_inputs", "activation_checkpoints", (arch.num_hidden_layers + 1, b, s, h), cdt))
    # the gradient flowing down the residual stream: a block's output grad and its input grad
    bufs.append(Buffer("residual_grad", "activation_checkpoints", (2, b, s, h), cdt))
    return bufs


def autograd_buffers(config: AprConfig, execution: Execution | None = None) -> list[Buffer]:
    """Plain autograd (``StandardEngine``, distillation's student) in one process or under DDP:
    parameters, torch AdamW's moments and every gradient until the update; the chunked LM-head loss
    holds its weight gradient from the forward until the backward."""
    arch = config.model.architecture
    groups = group_sizes(config)
    bufs = _params_and_moments(config, groups, execution)
    bufs += [Buffer(f"{name}.grad", "gradients", (numel,), "float32") for name, numel in groups]
    if config.model.lora is None:  # the loss phase's: it becomes the head's gradient in the backward
        bufs.append(Buffer("head_saved_grad", "logits_chunk", (arch.vocab_size, arch.hidden_size), "float32"))
    return bufs + _recompute_inputs(config, execution)


def _recompute_inputs(config: AprConfig, execution: Execution | None) -> list[Buffer]:
    """Autograd under the execution policy (``Engine.hidden_states``): each recomputed or selective
    block's input, saved by ``torch.utils.checkpoint``, and the last block's output, which the final
    norm saves when no kept graph holds it; none when every block is kept."""
    recomputed = (execution or from_config(config)).recomputed_blocks
    if not recomputed:
        return []
    arch = config.model.architecture
    b, s = config.data.batch_size, config.data.seq_len
    cdt = compute_dtype_name(config.training.mixed_precision)
    return [Buffer("block_inputs", "activation_checkpoints", (recomputed + 1, b, s, arch.hidden_size), cdt)]


def fsdp2_buffers(config: AprConfig, execution: Execution | None = None) -> list[Buffer]:
    """Either source under FSDP2, one rank's buffers (docs/distributed.md, "Sharding"): every
    parameter is split along its first dimension (rank 0 holds ``ceil(rows / ranks)`` rows, the
    largest), and so are its AdamW moments and its reduced gradient. ``full`` gathers a unit's
    weights (a block, adapters and frozen base alike) for its forward and again for its backward
    (the current block and the prefetched next one); ``shard_grad_op`` keeps every gathered block
    from its forward to its backward. A unit's unsharded gradient exists until it is
    reduce-scattered. Autograd (and the walk with kept gradients) holds every gradient shard until
    the update; the walk runs AdamW on each group's shard as it arrives and drops it (one group's
    shard at a time, ``grad_shard``), and keeps its blocks' inputs as it does unsharded."""
    tr, arch = config.training, config.model.architecture
    groups = group_sizes(config)
    shard = _group_shards(config, _shard_ranks(config))
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
    unit = largest
    if config.model.lora is not None:  # a unit gathers its frozen weights with its adapters
        root = sum(p.numel for p in embed_param_specs(arch)) + sum(p.numel for p in head_param_specs(arch))
        unit = max(largest + sum(p.numel for p in block_param_specs(arch, 0)), root)
    gathered = (sum(n for _, n in groups) + (param_count(arch) if config.model.lora else 0)
                if str(tr.sharding) == "shard_grad_op" else 2 * unit)
    if config.model.lora is None and str(tr.sharding) != "shard_grad_op":
        # the root unit (embedding, final norm, head) stays gathered from its forward to its backward;
        # a block is gathered with the next one prefetched, or beside its all-gather output while it
        # is copied out (traced on fake ranks, 2026-11-28)
        sizes = dict(groups)
        block = max((n for name, n in groups if name.startswith("block.")), default=0)
        gathered = sizes.get("embed", 0) + sizes.get("head", 0) + 2 * block
    elif config.model.lora is None:  # shard_grad_op: the whole model beside a block's all-gather output (traced)
        gathered += max((n for name, n in groups if name.startswith("block.")), default=0)
    bufs.append(Buffer("gathered_weights", "weights", (gathered,), "float32"))
    unsharded_grad = largest
    if config.model.lora is None:  # the root unit's (embedding, final norm, head) before its reduce-scatter
        sizes = dict(groups)
        unsharded_grad = max(largest, sizes.get("embed", 0) + sizes.get("head", 0))
    bufs.append(Buffer("unsharded_grad", "gradients", (unsharded_grad,), "float32"))
    b, s, h, v = config.data.batch_size, config.data.seq_len, arch.hidden_size, arch.vocab_size
    bufs.append(Buffer("head_saved_grad", "logits_chunk", (v, h), "float32"))  # the loss phase's
    # either source: recomputed blocks' inputs (saved by activation checkpointing); the walk's residual gradient
    cdt = compute_dtype_name(tr.mixed_precision)
    recomputed = (execution or from_config(config)).recomputed_blocks
    if recomputed:
        bufs.append(Buffer("block_inputs", "activation_checkpoints", (recomputed, b, s, h), cdt))
    if interleaved:
        bufs.append(Buffer("residual_grad", "activation_checkpoints", (2, b, s, h), cdt))
    return bufs


def source_buffers(config: AprConfig) -> Callable[[AprConfig, Execution | None], list[Buffer]]:
    """The declaration of the gradient source ``apr.train.build`` composes for ``config`` (the same
    decision: ``steps.execution.gradient_source`` and the sharding layout)."""
    if sharded(config):
        return fsdp2_buffers
    return walk_buffers if gradient_source(config) == "interleaved" else autograd_buffers


# ------------------------------------------------------------------------------------ every step


def step_buffers(config: AprConfig) -> list[Buffer]:
    """The tensors every step creates outside the blocks: the loss's logits chunks, the head's
    hidden states and the token ids.

    The chunked loss (apr/kernels/linear_ce.py) holds two chunks at its peak: the previous chunk's
    float32 logits (overwritten by their gradient) and its compute-dtype gradient stay referenced
    while the next chunk's matmul output and float32 logits are formed; one where the sequence fits
    in one chunk (``loss_chunk_size >= seq_len``, the trace's 1.7x over-count before). Under mixed precision the
    head weight is cast to the compute dtype once per step. Counted op by op on fake tensors
    (``apr train plan --trace``, 2026-11-28): 8 bytes per chunk element in fp32, 12 in bf16."""
    arch = config.model.architecture
    b, s, h, v = config.data.batch_size, config.data.seq_len, arch.hidden_size, arch.vocab_size
    cdt = compute_dtype_name(config.training.mixed_precision)
    if str(config.training.mode) == "distill":  # no phase runs the chunked loss: the KD loss's logits
        return [Buffer("token_ids", "inputs", (b, s + 1), "int64")]  # are distill_rows' (apr/memory/table.py)
    chunk = min(config.training.loss_chunk_size, s)
    live = min(2, -(-s // chunk))  # a sequence that fits in one chunk never has a next one beside it
    bufs = [Buffer("logits_chunk", "logits_chunk", (live, b, chunk, v), "float32")]  # d_logits in place
    if cdt != "float32":
        bufs.append(Buffer("logits_chunk_compute", "logits_chunk", (live, b, chunk, v), cdt))
        bufs.append(Buffer("head_weight_compute", "logits_chunk", (v, h), cdt))
        # one chunk's head-weight gradient in the compute dtype, before it is added in float32
        bufs.append(Buffer("head_grad_compute", "logits_chunk", (v, h), cdt))
    # the final-normed hidden states (float32: the norm weight is float32) and their gradient
    bufs.append(Buffer("head_hidden", "logits_chunk", (2, b, s, h), "float32"))
    bufs.append(Buffer("token_ids", "inputs", (b, s + 1), "int64"))
    return bufs


def buffer_plan(config: AprConfig, execution: Execution | None = None) -> list[Buffer]:
    """The composed engine's buffers: the LoRA transform's frozen base, the gradient source's own,
    every step's. ``execution``: the resolved policy (apr/steps/execution.py); default: the
    config's, ``auto`` as if memory were unlimited."""
    return frozen_buffers(config) + source_buffers(config)(config, execution) + step_buffers(config)
