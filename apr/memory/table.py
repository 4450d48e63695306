"""The per-GPU memory table: the buffer plan's sums by component (``apr.memory.buffers``), then the
modelled rows (``apr.memory.activations``, the CUDA context, the allocator's slack); the rows
other parts add (a distillation teacher, the orchestrator's state copies); and the deepest model or
largest micro-batch that fits a budget. Torch-free. ``apr.plan.memory`` chooses the execution
policy from these totals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from apr.config.schema import AprConfig
from apr.fmt import format_bytes
from apr.memory.activations import (
    COEFFICIENTS,
    MemoryCoefficients,
    block_activation_bytes,
    grads_replace_graph,
    kept_activation_bytes,
)
from apr.memory.buffers import (
    buffer_plan,
    compute_dtype_name,
    optimizer_state_details,
    sharded,
    state_dtype_details,
)
from apr.memory.canonical import canonical_bytes
from apr.model.spec import DTYPE_BYTES, trainable_param_count
from apr.steps import execution as policy
from apr.steps.execution import Execution

# Row order of the table; components the buffer plan adds later are appended after these.
_ORDER = ["frozen_weights", "weights", "compute_weights", "adapters", "adamw_m", "adamw_v", "gradients",
          "canonical_leaves", "activation_checkpoints", "kept_activations", "block_activations", "logits_chunk",
          "inputs", "cuda_context", "allocator_slack"]

DESCRIPTIONS = {
    "weights": "fp32 master weights, one flat buffer per block",
    "frozen_weights": "the frozen base model (LoRA): no gradient, no AdamW moments",
    "compute_weights": "each block's weights in the compute dtype, written by AdamW (no cast per forward)",
    "adapters": "LoRA adapters (fp32), one flat buffer per block",
    "adamw_m": "AdamW first moment (fp32)",
    "adamw_v": "AdamW second moment (fp32)",
    "gradients": "one gradient workspace (the largest group) or every group's gradient (kept)",
    "activation_checkpoints": "each block's input, kept for the recompute",
    "kept_activations": ("autograd graphs kept from forward to backward (execution policy; modelled); under "
                         "plain autograd with one micro-batch, beyond the gradients that replace them"),
    "block_activations": ("activations inside one block during recompute + backward, beyond the LM-head loss's "
                          "(the two never overlap; modelled)"),
    "logits_chunk": "one LM-head chunk of logits and its gradient (never full logits)",
    "inputs": "token ids of one micro-batch",
    "cuda_context": "CUDA context and library workspaces (modelled)",
    "allocator_slack": "caching-allocator fragmentation (modelled)",
}


@dataclass(frozen=True)
class MemoryRow:
    component: str
    bytes: int
    source: str  # "buffer_plan" or "modelled"
    buffers: int  # how many buffer-plan entries the row sums (0 for modelled rows)
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


def memory_table(config: AprConfig, coefficients: MemoryCoefficients = COEFFICIENTS,
                 execution: Execution | None = None) -> list[MemoryRow]:
    """Per-GPU bytes by component under ``execution`` (default: the config's policy, ``auto`` as if
    memory were unlimited): buffer-plan sums, then the modelled rows."""
    execution = execution or policy.from_config(config)
    sums: dict[str, list[int]] = {}
    for buf in buffer_plan(config, execution):
        entry = sums.setdefault(buf.component, [0, 0])
        entry[0] += buf.nbytes
        entry[1] += 1
    # Lion's, Adafactor's state rows; bf16 state's
    words = {**DESCRIPTIONS, **optimizer_state_details(config), **state_dtype_details(config)}
    rows = {name: MemoryRow(name, total, "buffer_plan", n, words.get(name, "from the buffer plan"))
            for name, (total, n) in sums.items()}
    kept = kept_activation_bytes(config, execution, coefficients)
    if grads_replace_graph(config):
        # plain autograd, one micro-batch: the gradients appear in the backward as the graph is freed
        # (at the forward's end, the step's peak, none exists), so the row is the graph beyond them
        kept = max(0, kept - rows["gradients"].bytes) if "gradients" in rows else kept
    rows["kept_activations"] = MemoryRow("kept_activations", kept, "modelled", 0,
                                         DESCRIPTIONS["kept_activations"])
    # one block's recompute and backward never overlaps the LM-head loss: the row is what the block
    # phase holds beyond the loss phase's logits chunks (the step's peak is the larger of the two)
    head = rows["logits_chunk"].bytes if "logits_chunk" in rows else 0
    rows["block_activations"] = MemoryRow("block_activations",
                                          max(0, block_activation_bytes(config, coefficients, execution) - head),
                                          "modelled", 0, DESCRIPTIONS["block_activations"])
    if str(config.training.reduction) == "canonical":  # the micro-batches' gradients kept apart for the tree
        rows["canonical_leaves"] = _canonical_row(config, rows)
    allocated = sum(r.bytes for r in rows.values())
    if str(config.training.device) != "cpu":  # a CPU run creates no CUDA context (device auto may be a GPU)
        rows["cuda_context"] = MemoryRow("cuda_context", coefficients.cuda_context_bytes, "modelled", 0,
                                         DESCRIPTIONS["cuda_context"])
    rows["allocator_slack"] = MemoryRow("allocator_slack", int(allocated * coefficients.allocator_slack_fraction),
                                        "modelled", 0, DESCRIPTIONS["allocator_slack"] if str(config.training.device)
                                        != "cpu" else "the host allocator's fragmentation and headroom (modelled)")
    order = [c for c in _ORDER if c in rows] + [c for c in rows if c not in _ORDER]
    return [rows[c] for c in order]


def _canonical_row(config: AprConfig, rows: dict[str, MemoryRow]) -> MemoryRow:
    """canonical's bytes at the step's peak, beside the rows already in the table: during the last
    micro-batch's backward its ``accumulation - 1`` earlier leaves live beside the activations; at the
    sum (apr/memory/canonical.py's peak) the activations and the loss's chunks are gone. The row is
    the larger of the two excesses over what the other rows hold."""
    grad = DTYPE_BYTES["float32"] * trainable_param_count(config)
    cost = canonical_bytes(config, grad, int(config.training.world_size))
    freed = sum(rows[c].bytes for c in ("activation_checkpoints", "kept_activations", "block_activations",
                                         "logits_chunk") if c in rows)
    # autograd's .grad and FSDP2's unsharded gradients are moved into each micro-batch's leaf (the
    # replicated walk's kept buffers stay): the gradients row is not held beside the leaves
    grads = rows["gradients"].bytes if "gradients" in rows and (
        policy.gradient_source(config) == "standard" or sharded(config)) else 0
    during = max(0, (int(config.training.gradient_accumulation) - 1) * grad - grads)
    freed += grads
    return MemoryRow("canonical_leaves", max(during, cost.extra - freed), "modelled", 0,
                     f"training.reduction: canonical: {cost.leaves} micro-batch gradients summed in the fixed tree "
                     f"({format_bytes(cost.extra)} at the sum, when the activations are gone; the earlier "
                     "micro-batches' during the last backward): what the step's peak holds beyond the other rows")


def total_bytes(config: AprConfig, coefficients: MemoryCoefficients = COEFFICIENTS,
                execution: Execution | None = None) -> int:
    return sum(r.bytes for r in memory_table(config, coefficients, execution))


def with_batch_size(config: AprConfig, batch_size: int) -> AprConfig:
    return config.model_copy(update={"data": config.data.model_copy(update={"batch_size": batch_size})})


def _largest_fitting(fits, limit: int) -> int:
    """The largest n in 1..limit with ``fits(n)``, for a ``fits`` that turns false past some n
    (memory grows with the batch and the depth): gallop, then bisect; 0 if not even 1 fits."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _fits_leanest(cfg: AprConfig, vram_bytes: int, coefficients: MemoryCoefficients) -> bool:
    return min(total_bytes(cfg, coefficients, e) for e in lean_candidates(cfg)) <= vram_bytes


def max_micro_batch(config: AprConfig, vram_bytes: int, limit: int = 1 << 16,
                    coefficients: MemoryCoefficients = COEFFICIENTS) -> int:
    """The largest micro-batch (at this seq_len) whose total fits in ``vram_bytes`` under the leanest
    policy the config allows; 0 if none does."""
    return _largest_fitting(
        lambda b: _fits_leanest(with_batch_size(config, b), vram_bytes, coefficients), limit)


def with_layers(config: AprConfig, layers: int) -> AprConfig:
    arch = config.model.architecture.model_copy(update={"num_hidden_layers": layers})
    return config.model_copy(update={"model": config.model.model_copy(update={"architecture": arch})})


MAX_LAYERS_SEARCHED = 4096


def max_layers(config: AprConfig, vram_bytes: int, limit: int = MAX_LAYERS_SEARCHED,
               coefficients: MemoryCoefficients = COEFFICIENTS) -> int:
    """The deepest model of this width (and batch) whose total fits in ``vram_bytes`` under the
    leanest policy the config allows (``limit`` when even that many fit); 0 if not one block does."""
    return _largest_fitting(
        lambda n: _fits_leanest(with_layers(config, n), vram_bytes, coefficients), limit)


def coefficients_dict(coefficients: MemoryCoefficients = COEFFICIENTS, device: str | None = None) -> dict:
    """The coefficients the memory rows use; on the CPU (``device`` cpu) without the CUDA context's."""
    doc = asdict(coefficients)
    if device == "cpu":
        doc.pop("cuda_context_bytes", None)
    return doc


def lean_candidates(config: AprConfig) -> list[Execution]:
    """The policies that may be the leanest the config allows, each gradient choice: the most blocks
    recomputed in full, and every graph kept (where gradients replace the graph, on autograd or FSDP2
    with one micro-batch, a kept graph smaller than them costs nothing at the peak, and keeping every
    one can be leaner than recomputing them)."""
    all_ = policy.candidates(config)
    most = max(e.recomputed_blocks for e in all_)
    pool = [e for e in all_ if e.recomputed_blocks == most]
    lean = [e for e in pool if e.rest == "recompute"] or pool
    if grads_replace_graph(config):
        lean += [e for e in all_ if e.recomputed_blocks == 0 and e not in lean]
    return lean


# ------------------------------------------------------------------------ rows other parts add


def distill_rows(config: AprConfig, teacher_params: int, projection_params: int) -> list[MemoryRow]:
    """Distillation's rows beside the student's table: the frozen teacher, a narrower student's two
    projections (weights, gradients and AdamW moments) and phase 2's logits."""
    arch = config.model.architecture
    b, s, v = config.data.batch_size, config.data.seq_len, arch.vocab_size
    elt = DTYPE_BYTES[compute_dtype_name(config.training.mixed_precision)]
    # phase 2's loss at its peak (traced, 2026-11-28): the student's logits in the compute dtype, their
    # float32 copy, its log-softmax twice (the cross-entropy's, the tempered one), the teacher's logits
    # and tempered log-softmax, the KL's pointwise terms, one tempered temporary; under mixed
    # precision autocast's copy of the head weight too
    kd = b * s * v * (elt + 7 * 4) + (arch.vocab_size * arch.hidden_size * elt if elt != 4 else 0)
    return [MemoryRow("teacher_weights", 4 * teacher_params, "exact", 0,
                      "the frozen teacher in float32 (no gradient, no moments)"),
            *([MemoryRow("distill_projections", 16 * projection_params, "exact", 0, "a narrower student's two "
                         "projections to and from the teacher's hidden size: float32 weights, gradients, AdamW "
                         "moments")] if projection_params else []),
            MemoryRow("kd_logits", kd, "modelled", 0,
                      "phase 2: student and teacher logits and their log-softmaxes for one micro-batch")]


# The engine's state a copy holds (an orchestrator branch, a rollback snapshot): the float32 weights
# and the optimizer's two moments.
STATE_COMPONENTS = ("weights", "adamw_m", "adamw_v")


def state_bytes(by_component: dict) -> int:
    """The bytes of one copy of the engine's state, from a table's ``by_component``."""
    return sum(int(by_component.get(c) or 0) for c in STATE_COMPONENTS)


def orchestrator_rows(state_copies: int, nowcast_copies: int, by_component: dict) -> list[MemoryRow]:
    """The orchestrator's copies (exact: the sizes of the engine's own)."""
    state, rows = state_bytes(by_component), []
    if state_copies and state:
        rows.append(MemoryRow("branch_states", state_copies * state, "exact", 0,
                              "orchestrator: the decision point's state and the best branch's (weights + moments)"))
    if nowcast_copies and by_component.get("weights"):
        rows.append(MemoryRow("nowcast_weights", nowcast_copies * int(by_component["weights"]), "exact", 0,
                              "orchestrator: the weights at the last decision points (nowcasting.history)"))
    return rows


def add_rows(memory: dict, rows: list[MemoryRow]) -> None:
    """Add ``rows`` to a plan's memory facts: its total, its rows by component, its share of the budget."""
    memory["total_bytes"] += sum(r.bytes for r in rows)
    memory["by_component"].update({r.component: r.bytes for r in rows})
    if memory.get("vram_bytes"):
        memory["usage_fraction"] = memory["total_bytes"] / memory["vram_bytes"]
