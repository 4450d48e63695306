"""The activations the memory table models: what the execution policy keeps from the forward to the
backward, and what one block holds while it is recomputed and backpropagated (docs/plan.md,
"Memory"). Torch-free.

Everything the trainer allocates up front is declared (``apr.memory.buffers``); only four things are
modelled, and their coefficients live in ``COEFFICIENTS`` below and nowhere else, so that a
calibration against measured peaks on a real GPU changes one place:

* the autograd graphs the execution policy keeps from the forward to the backward,
* the activations that exist inside one block while it is recomputed and backpropagated,
* the CUDA context (driver, cuBLAS workspaces; visible in nvidia-smi, not in torch's counters),
* the caching allocator's slack (fragmentation and rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

from apr.config.schema import AprConfig
from apr.memory.buffers import compute_dtype_name, sharded, uses_compute_copy
from apr.model.spec import DTYPE_BYTES, block_numel, mlp_token_width, routed_rows
from apr.steps import execution as policy
from apr.steps import stacking
from apr.steps.execution import Execution

_MIB = 2**20


@dataclass(frozen=True)
class MemoryCoefficients:
    # Per token of the micro-batch, in compute-dtype elements: tensors alive while one block is
    # recomputed and backpropagated (saved activations plus the gradients flowing through them).
    # x, norms, q, attention out, o_proj out, residuals (+ grads); 8, not 12, under mixed precision
    # (4 of them autocast's compute-dtype copies, absent in fp32): the engine's trace on fake tensors
    # (2026-11-28) at two shapes (h 256 and 512)
    block_hidden_widths: float = 4.0
    block_autocast_hidden_widths: float = 4.0
    block_kv_widths: float = 4.0  # k, v before and after RoPE
    block_intermediate_widths: float = 6.0  # SwiGLU gate, up, silu(gate), product (+ grads)
    # b * heads * s * s score tensors; 0 because flash / memory-efficient SDPA never materialises them.
    attention_score_copies: float = 0.0
    # Under mixed precision, autocast's compute-dtype copies of one block's weights and their grads.
    block_weight_cast_copies: float = 2.0
    # Per token, in compute-dtype elements: what autograd saves for a block whose graph is kept
    # (beyond its input, which is an activation checkpoint anyway). Counted with
    # torch.autograd.graph.saved_tensors_hooks on the CPU (2026-11-24): norm outputs and the residual
    # (hidden), q/k/v after rope, attention output, SwiGLU gate, up, silu and product (intermediate).
    # The engine's trace on fake tensors (apr train plan --trace, 2026-11-28) found one more hidden
    # width and the two RMSNorms' float32 inputs (keep_norm_fp32_widths, in float32 elements).
    # Under mixed precision only (the norm's input is already float32 in fp32, and nothing is cast).
    keep_hidden_widths: float = 8.0
    keep_autocast_hidden_widths: float = 1.0
    keep_norm_fp32_widths: float = 2.0
    # A kept graph's backward adds, per token, about one intermediate width of gradients (traced).
    keep_backward_intermediate_widths: float = 1.0
    # ... and about four under one autograd graph (plain autograd, FSDP2), which keeps each activation's
    # gradient until the op that consumes it has run.
    autograd_backward_intermediate_widths: float = 4.0
    keep_kv_widths: float = 2.0
    keep_intermediate_widths: float = 4.0
    # Selective recompute keeps only the matmul and attention outputs: q, o_proj, down_proj and the
    # attention output (hidden), k and v, gate and up (intermediate); counted from the op list.
    selective_hidden_widths: float = 4.0
    selective_kv_widths: float = 2.0
    selective_intermediate_widths: float = 2.0
    # A mixture of experts (model.architecture.moe; "intermediate" above is then a token's top_k
    # experts' widths together): per routed copy of a token's row (top_k of them), the hidden widths
    # its routing adds to a kept graph: the copy regrouped by expert and the expert's output put back
    # in token order (counted with saved_tensors_hooks on the CPU, 2026-11-28: 2 x top_k x hidden
    # beyond the dense MLP's, plus the router's few floats per token, not counted). While a block is
    # recomputed and backpropagated, the routing's copies, the experts' outputs and their gradients:
    # fitted to the engine's trace on fake tensors (2026-11-28, h 256, 4 experts, bf16), which found
    # 25 (top 2) and 36 (top 1) widths per routed row under recompute, 9 and 3 under selective.
    keep_routing_hidden_widths: float = 2.0
    block_routing_hidden_widths: float = 16.0
    # Measured on an H200 (CUDA 13.0, torch 2.11, CuPy 14.2; 2026-11-26): the device memory in use
    # beyond torch's reserved pool was 766.8 MiB in all seven cases of benchmarks/vram_calibration.py
    # (it was 512 MiB, uncalibrated).
    cuda_context_bytes: int = 768 * _MIB
    # Of everything torch allocates. Measured on the same H200: the pool's own slack (reserved over
    # allocated) is 1-3%; the rest of this 10% covers allocations the rows do not itemise (buffers
    # measured 9-11% and the step's activations 19-29% above their rows), so the total, not each
    # row, is what matches: peak within 3% and device memory within 3% over the seven cases
    # (docs/performance.md, "GPU: memory model").
    allocator_slack_fraction: float = 0.10
    calibrated: bool = True
    source: str = ("totals calibrated on an H200 (2026-11-26, 7 cases: peak within 3%); per-row activation "
                   "widths from tensor counting (2026-11-22)")


COEFFICIENTS = MemoryCoefficients()


def block_activation_bytes(config: AprConfig, c: MemoryCoefficients = COEFFICIENTS,
                           execution: Execution | None = None) -> int:
    """One block's backward (modelled), whole, for the costliest kind of block the policy has: a
    recomputed block's forward and backward; a selective block's, less the matmul outputs it kept;
    a kept graph's backward, which only adds gradients (one intermediate width and the weights'
    compute-dtype gradients; measured on fake tensors, 2026-11-28). The table's row is its excess over
    the LM-head loss's."""
    arch = config.model.architecture
    tr = config.training
    execution = execution or policy.from_config(config)
    b, s = config.data.batch_size, config.data.seq_len
    elt = DTYPE_BYTES[compute_dtype_name(tr.mixed_precision)]
    kv = arch.kv_heads * arch.head_dim
    mixed = str(tr.mixed_precision) != "fp32"
    hidden = c.block_hidden_widths + (c.block_autocast_hidden_widths if mixed else 0)
    inter, routed = mlp_token_width(arch), c.block_routing_hidden_widths * routed_rows(arch) * arch.hidden_size
    per_token = (hidden * arch.hidden_size + c.block_kv_widths * kv
                 + c.block_intermediate_widths * inter + routed)
    scores = c.attention_score_copies * b * arch.num_attention_heads * s * s
    # with the interleaved engine's compute copy only the weights' compute-dtype gradients remain
    copies = c.block_weight_cast_copies - (1 if _reads_compute_copy(config, execution) else 0)
    weight_casts = copies * block_numel(arch) if str(tr.mixed_precision) != "fp32" else 0
    # FSDP2 holds the head's float32 gradient with the root unit until its reduce-scatter, after the
    # embedding's backward: through every block's (traced on 8 fake ranks, 2026-11-28)
    root_grad = (arch.vocab_size * arch.hidden_size * DTYPE_BYTES["float32"]
                 if sharded(config) and config.model.lora is None else 0)
    recomputed = execution.recomputed_blocks  # every source honours the policy (Engine.hidden_states)
    if recomputed and execution.rest == "recompute":
        return int((b * s * per_token + scores + weight_casts) * elt) + root_grad
    if recomputed:  # selective: the matmul and attention outputs are kept, the rest recomputed
        kept = (c.selective_hidden_widths * arch.hidden_size + c.selective_kv_widths * kv
                + c.selective_intermediate_widths * inter)
        return int((b * s * (per_token - kept) + scores + weight_casts) * elt) + root_grad
    one_graph = policy.gradient_source(config) == "standard" or sharded(config)
    grads = (c.autograd_backward_intermediate_widths if one_graph
             else c.keep_backward_intermediate_widths) * inter
    return int((b * s * grads + weight_casts) * elt) + root_grad


def frozen_blocks(config: AprConfig) -> dict[int, tuple[frozenset[str], str, int]]:
    """Blocks whose base weights get no gradient: block -> (its projections with adapters, the
    storage of its projections, the adapters' rank). Every block under ``model.lora``; a stacking
    stage's transformed trunk (``apr.steps.stacking.trunk_storage``)."""
    lora = config.model.lora
    if lora is not None:
        return dict.fromkeys(range(config.model.architecture.num_hidden_layers),
                             (frozenset(lora.modules), str(lora.trunk_dtype), lora.rank))
    out = {}
    for b, storage in stacking.trunk_storage(config).items():
        adapters = stacking.block_adapters(config, b)  # each block at the rank of the stage that added it
        out[b] = (frozenset(adapters.modules), storage, adapters.rank) if adapters is not None else \
            (frozenset(), storage, 0)
    return out


def _frozen_saving(config: AprConfig, adapted: frozenset[str], rank: int) -> float:
    """Bytes per token a frozen block's graph does not save beside a trained one's: the RMSNorms'
    float32 normalised inputs (no norm weight gradient) and the inputs of projections without an
    adapter (no weight gradient), less each adapter's rank-wide output. Under autocast each
    projection saves its own compute-dtype cast of its input (q, k, v, gate and up; o_proj reads the
    attention output, which attention saves anyway); in float32 q/k/v and gate/up share theirs.
    Counted with saved_tensors_hooks on the CPU (2026-11-28): h 256, i 768, rank 8, bf16 and fp32."""
    arch = config.model.architecture
    h, inter = arch.hidden_size, arch.intermediate_size
    cdt = compute_dtype_name(config.training.mixed_precision)
    elt = DTYPE_BYTES[cdt]
    frozen = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} - adapted
    saving = 2 * h * DTYPE_BYTES["float32"]
    if cdt != "float32":
        saving += elt * h * len(frozen & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
    else:
        saving += elt * h * (({"q_proj", "k_proj", "v_proj"} <= frozen) + ({"gate_proj", "up_proj"} <= frozen))
    saving += elt * inter * ("down_proj" in frozen)
    return saving - elt * rank * len(adapted)


def kept_block_bytes(config: AprConfig, execution: Execution | None = None,
                     c: MemoryCoefficients = COEFFICIENTS, block: int | None = None) -> int:
    """What autograd saves for one block whose graph is kept (modelled): its activations, per token,
    and autocast's compute-dtype copy of its weights where no compute copy is read (none where the
    frozen weights are stored in the compute dtype). ``block``: that block (a frozen one saves less)."""
    arch = config.model.architecture
    b, s = config.data.batch_size, config.data.seq_len
    cdt = compute_dtype_name(config.training.mixed_precision)
    elt = DTYPE_BYTES[cdt]
    kv = arch.kv_heads * arch.head_dim
    mixed = cdt != "float32"
    hidden = c.keep_hidden_widths + (c.keep_autocast_hidden_widths if mixed else 0)
    keep = ((hidden * arch.hidden_size + c.keep_kv_widths * kv + c.keep_intermediate_widths * mlp_token_width(arch)
             + c.keep_routing_hidden_widths * routed_rows(arch) * arch.hidden_size) * elt
            + (c.keep_norm_fp32_widths * arch.hidden_size * DTYPE_BYTES["float32"] if mixed else 0))
    # autocast saves its compute-dtype copy of a kept block's weights for the backward, unless the
    # blocks read the interleaved engine's compute copy
    casts = block_numel(arch) * elt if mixed and not _reads_compute_copy(config, execution) else 0
    frozen = frozen_blocks(config).get(block) if block is not None else None
    if frozen is not None:
        adapted, storage, rank = frozen
        keep -= _frozen_saving(config, adapted, rank)
        if storage == {"bfloat16": "bf16", "float16": "fp16"}.get(cdt):  # autocast has nothing to cast
            casts = 0
    return int(b * s * keep + casts)


def kept_activation_bytes(config: AprConfig, execution: Execution,
                          c: MemoryCoefficients = COEFFICIENTS) -> int:
    """The autograd graphs kept from the forward to the backward, whole (modelled): the kept blocks'
    and what selective blocks keep of theirs."""
    arch = config.model.architecture
    b, s = config.data.batch_size, config.data.seq_len
    elt = DTYPE_BYTES[compute_dtype_name(config.training.mixed_precision)]
    kv = arch.kv_heads * arch.head_dim
    sel = (c.selective_hidden_widths * arch.hidden_size + c.selective_kv_widths * kv
           + c.selective_intermediate_widths * mlp_token_width(arch))
    selective_blocks = execution.recomputed_blocks if execution.rest == "selective" else 0
    frozen = frozen_blocks(config)  # a frozen block saves less; every other kept block saves the same
    trained = kept_block_bytes(config, execution, c) if execution.kept_blocks > len(frozen) else 0
    kept = sum(kept_block_bytes(config, execution, c, block=i) if i in frozen else trained
               for i in range(execution.kept_blocks))
    return int(kept + b * s * selective_blocks * sel * elt)


def _reads_compute_copy(config: AprConfig, execution: Execution | None) -> bool:
    """The blocks read the interleaved engine's compute copy (never under FSDP2, which gathers fp32)."""
    return uses_compute_copy(config, execution) and not sharded(config)


def grads_replace_graph(config: AprConfig) -> bool:
    """Gradients that start at None each step and appear as the backward frees the graph: plain
    autograd, or either source under FSDP2, with one micro-batch."""
    tr = config.training
    return ((policy.gradient_source(config) == "standard" or sharded(config))
            and tr.gradient_accumulation == 1)
