"""The per-GPU memory budget: the trainer's buffer plan plus the few things it cannot list.

Everything the trainer allocates up front comes from ``apr.model.buffers.buffer_plan`` (docs/design.md,
"The buffer plan"): the plan sums exactly what ``apply`` allocates. Only four things are modelled, and
their coefficients live in ``COEFFICIENTS`` below and nowhere else, so that a calibration against
measured peaks on a real GPU changes one place:

* the autograd graphs the execution policy keeps from the forward to the backward,
* the activations that exist inside one block while it is recomputed and backpropagated,
* the CUDA context (driver, cuBLAS workspaces; visible in nvidia-smi, not in torch's counters),
* the caching allocator's slack (fragmentation and rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from apr.config.schema import AprConfig
from apr.model.buffers import buffer_plan, compute_dtype_name, optimizer_state_details, sharded, uses_compute_copy
from apr.model.spec import DTYPE_BYTES, block_numel
from apr.steps import execution as policy
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

# Row order of the table; components the buffer plan adds later are appended after these.
_ORDER = ["frozen_weights", "weights", "compute_weights", "adapters", "adamw_m", "adamw_v", "gradients",
          "activation_checkpoints", "kept_activations", "block_activations", "logits_chunk", "inputs",
          "cuda_context", "allocator_slack"]

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
    per_token = (hidden * arch.hidden_size + c.block_kv_widths * kv
                 + c.block_intermediate_widths * arch.intermediate_size)
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
                + c.selective_intermediate_widths * arch.intermediate_size)
        return int((b * s * (per_token - kept) + scores + weight_casts) * elt) + root_grad
    one_graph = policy.gradient_source(config) == "standard" or sharded(config)
    grads = (c.autograd_backward_intermediate_widths if one_graph
             else c.keep_backward_intermediate_widths) * arch.intermediate_size
    return int((b * s * grads + weight_casts) * elt) + root_grad


def kept_activation_bytes(config: AprConfig, execution: Execution,
                          c: MemoryCoefficients = COEFFICIENTS) -> int:
    """The autograd graphs kept from the forward to the backward, whole (modelled)."""
    arch = config.model.architecture
    b, s = config.data.batch_size, config.data.seq_len
    cdt = compute_dtype_name(config.training.mixed_precision)
    elt = DTYPE_BYTES[cdt]
    kv = arch.kv_heads * arch.head_dim
    mixed = cdt != "float32"
    hidden = c.keep_hidden_widths + (c.keep_autocast_hidden_widths if mixed else 0)
    keep = ((hidden * arch.hidden_size + c.keep_kv_widths * kv
             + c.keep_intermediate_widths * arch.intermediate_size) * elt
            + (c.keep_norm_fp32_widths * arch.hidden_size * DTYPE_BYTES["float32"] if mixed else 0))
    # autocast saves its compute-dtype copy of a kept block's weights for the backward, unless the
    # blocks read the interleaved engine's compute copy
    casts = block_numel(arch) * elt if cdt != "float32" and not _reads_compute_copy(config, execution) else 0
    sel = (c.selective_hidden_widths * arch.hidden_size + c.selective_kv_widths * kv
           + c.selective_intermediate_widths * arch.intermediate_size)
    selective_blocks = execution.recomputed_blocks if execution.rest == "selective" else 0
    return int(execution.kept_blocks * (b * s * keep + casts) + b * s * selective_blocks * sel * elt)


def _reads_compute_copy(config: AprConfig, execution: Execution | None) -> bool:
    """The blocks read the interleaved engine's compute copy (never under FSDP2, which gathers fp32)."""
    return uses_compute_copy(config, execution) and not sharded(config)


def _grads_replace_graph(config: AprConfig) -> bool:
    """Gradients that start at None each step and appear as the backward frees the graph: plain
    autograd, or either source under FSDP2, with one micro-batch."""
    tr = config.training
    return ((policy.gradient_source(config) == "standard" or sharded(config))
            and tr.gradient_accumulation == 1)


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
    words = {**DESCRIPTIONS, **optimizer_state_details(config)}  # Lion's, Adafactor's state rows
    rows = {name: MemoryRow(name, total, "buffer_plan", n, words.get(name, "from the buffer plan"))
            for name, (total, n) in sums.items()}
    kept = kept_activation_bytes(config, execution, coefficients)
    if _grads_replace_graph(config):
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
    allocated = sum(r.bytes for r in rows.values())
    if str(config.training.device) != "cpu":  # a CPU run creates no CUDA context (device auto may be a GPU)
        rows["cuda_context"] = MemoryRow("cuda_context", coefficients.cuda_context_bytes, "modelled", 0,
                                         DESCRIPTIONS["cuda_context"])
    rows["allocator_slack"] = MemoryRow("allocator_slack", int(allocated * coefficients.allocator_slack_fraction),
                                        "modelled", 0, DESCRIPTIONS["allocator_slack"] if str(config.training.device)
                                        != "cpu" else "the host allocator's fragmentation and headroom (modelled)")
    order = [c for c in _ORDER if c in rows] + [c for c in rows if c not in _ORDER]
    return [rows[c] for c in order]


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
    return min(total_bytes(cfg, coefficients, e) for e in _lean_candidates(cfg)) <= vram_bytes


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


# ------------------------------------------------------------------------------ execution choice


def step_cost_f(config: AprConfig, execution: Execution) -> float:
    """``steps.execution.step_cost_f``, with autograd's recompute counted: every source honours the
    activation policy, so a recomputed block costs its forward again on autograd too (without it the
    plan would rank recompute as free there and pick it as the leanest at the same cost)."""
    extra = execution.recompute_f() if policy.gradient_source(config) == "standard" else 0.0
    return policy.step_cost_f(config, execution) + extra


def _lean_candidates(config: AprConfig) -> list[Execution]:
    """The leanest policies the config allows: the most blocks recomputed in full, each gradient choice."""
    all_ = policy.candidates(config)
    most = max(e.recomputed_blocks for e in all_)
    pool = [e for e in all_ if e.recomputed_blocks == most]
    return [e for e in pool if e.rest == "recompute"] or pool


@dataclass
class ExecutionChoice:
    """The policy the plan hands to the engine, why, and what the alternatives would cost."""

    execution: Execution
    auto: bool  # some part of the policy was ``auto``
    budget_bytes: int | None  # what the choice had to fit in; None: no budget (the fastest policy)
    budget_source: str | None
    cost_f: float
    total_bytes: int
    fits: bool | None  # None without a budget
    fastest_fitting: Execution | None  # the fastest policy of any kind that fits the budget
    alternatives: list[dict] = field(default_factory=list)

    def facts(self, config: AprConfig) -> dict:
        fit = self.fastest_fitting
        out = {"policy": self.execution.to_dict(), "policy_auto": self.auto, "cost_f": self.cost_f,
               "policy_line": policy.describe(config, self.execution), "policy_bytes": self.total_bytes,
               "alternatives": self.alternatives}
        if self.budget_bytes is not None:
            out.update(budget_bytes=self.budget_bytes, budget_source=self.budget_source, policy_fits=bool(self.fits),
                       policy_cost=policy.fmt_f(self.cost_f))
            if fit is not None:
                out["fastest_fitting"] = {"activations": fit.activations, "gradients": fit.gradients,
                                          "cost_f": step_cost_f(config, fit),
                                          "cost": policy.fmt_f(step_cost_f(config, fit)),
                                          "total_bytes": total_bytes(config, execution=fit)}
        return out


def choose_execution(config: AprConfig, budget_bytes: int | None = None, budget_source: str | None = None,
                     coefficients: MemoryCoefficients = COEFFICIENTS) -> ExecutionChoice:
    """Resolve ``training.execution``: stated parts are kept; each ``auto`` part takes the fastest
    value (fewest forward-equivalents, then the least memory) whose total fits ``budget_bytes``;
    with no budget, the fastest; when nothing fits, the leanest (the memory contract then fails)."""
    ex = config.training.execution
    auto = ex.activations == "auto" or str(ex.gradients) == "auto"

    def key(e: Execution) -> tuple:
        return (step_cost_f(config, e), total_bytes(config, coefficients, e))

    ranked = sorted(((key(e), e) for e in policy.candidates(config)), key=lambda t: t[0])
    fits = [e for (_, b), e in ranked if budget_bytes is None or b <= budget_bytes]
    chosen = fits[0] if fits else min(ranked, key=lambda t: t[0][1])[1]
    # the fastest policy of any kind that fits: what a finding suggests instead of a stated misfit
    free = config.model_copy(update={"training": config.training.model_copy(
        update={"execution": ex.model_copy(update={"activations": "auto", "gradients": "auto"})})})
    fastest_fitting = None
    if budget_bytes is not None:
        any_fit = sorted(((key(e), e) for e in policy.candidates(free)), key=lambda t: t[0])
        fastest_fitting = next((e for (_, b), e in any_fit if b <= budget_bytes), None)
    cost, total = key(chosen)
    return ExecutionChoice(
        execution=chosen, auto=auto, budget_bytes=budget_bytes, budget_source=budget_source, cost_f=cost,
        total_bytes=total, fits=None if budget_bytes is None else total <= budget_bytes,
        fastest_fitting=fastest_fitting, alternatives=alternatives(free, chosen, budget_bytes, coefficients))


def alternatives(config: AprConfig, chosen: Execution, budget_bytes: int | None,
                 coefficients: MemoryCoefficients = COEFFICIENTS) -> list[dict]:
    """The named policies (keep, selective, recompute, and the chosen keep_first:K), each gradient
    choice the config allows, with cost and memory: the plan's table of alternatives."""
    rows, seen = [], set()
    for e in policy.candidates(config):
        if e.activations.startswith("keep_first:") and e.activations != chosen.activations:
            continue
        label = (e.activations, e.gradients)
        if label in seen:
            continue
        seen.add(label)
        total = total_bytes(config, coefficients, e)
        rows.append({"activations": e.activations, "gradients": e.gradients,
                     "cost_f": step_cost_f(config, e), "total_bytes": total,
                     "fits": None if budget_bytes is None else total <= budget_bytes,
                     "chosen": label == (chosen.activations, chosen.gradients)})
    return sorted(rows, key=lambda r: (r["cost_f"], r["total_bytes"]))
