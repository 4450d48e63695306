"""The per-GPU memory budget: the trainer's buffer plan plus the few things it cannot list.

Everything the trainer allocates up front comes from ``apr.model.spec.buffer_plan`` (DESIGN.md
decision 1): the plan sums exactly what ``apply`` allocates. Only three things are modelled, and
their coefficients live in ``COEFFICIENTS`` below and nowhere else, so that a calibration against
measured peaks on a real GPU changes one place:

* the activations that exist inside one block while it is recomputed and backpropagated,
* the CUDA context (driver, cuBLAS workspaces; visible in nvidia-smi, not in torch's counters),
* the caching allocator's slack (fragmentation and rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from apr.config.schema import AprConfig
from apr.model.spec import DTYPE_BYTES, block_numel, buffer_plan, compute_dtype

_MIB = 2**20


@dataclass(frozen=True)
class MemoryCoefficients:
    # Per token of the micro-batch, in compute-dtype elements: tensors alive while one block is
    # recomputed and backpropagated (saved activations plus the gradients flowing through them).
    block_hidden_widths: float = 12.0  # x, norms, q, attention out, o_proj out, residuals (+ grads)
    block_kv_widths: float = 4.0  # k, v before and after RoPE
    block_intermediate_widths: float = 6.0  # SwiGLU gate, up, silu(gate), product (+ grads)
    # b * heads * s * s score tensors; 0 because flash / memory-efficient SDPA never materialises them.
    attention_score_copies: float = 0.0
    # Under mixed precision, autocast's compute-dtype copies of one block's weights and their grads.
    block_weight_cast_copies: float = 2.0
    # float32 softmax temporaries of one logits chunk, beyond the chunk and its gradient buffers.
    logits_extra_copies: float = 1.0
    cuda_context_bytes: int = 512 * _MIB
    allocator_slack_fraction: float = 0.10  # of everything torch allocates
    calibrated: bool = False
    source: str = "uncalibrated estimates from tensor counting (2026-11-22); calibrate on a GPU"


COEFFICIENTS = MemoryCoefficients()

# Row order of the table; components the buffer plan adds later are appended after these.
_ORDER = ["weights", "adamw_m", "adamw_v", "gradients", "activation_checkpoints", "block_activations",
          "logits_chunk", "inputs", "cuda_context", "allocator_slack"]

DESCRIPTIONS = {
    "weights": "fp32 master weights, one flat buffer per block",
    "adamw_m": "AdamW first moment (fp32)",
    "adamw_v": "AdamW second moment (fp32)",
    "gradients": "gradient workspace (one block) or per-group gradients under accumulation",
    "activation_checkpoints": "each block's input, kept for the recompute",
    "block_activations": "activations inside one block during recompute + backward (modelled)",
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


def _block_activation_bytes(config: AprConfig, c: MemoryCoefficients) -> int:
    arch = config.model.architecture
    tr = config.training
    b, s = config.data.batch_size, config.data.seq_len
    elt = DTYPE_BYTES[compute_dtype(tr.mixed_precision)]
    hd = arch.hidden_size // arch.num_attention_heads
    per_token = (c.block_hidden_widths * arch.hidden_size + c.block_kv_widths * arch.kv_heads * hd
                 + c.block_intermediate_widths * arch.intermediate_size)
    scores = c.attention_score_copies * b * arch.num_attention_heads * s * s
    weight_casts = c.block_weight_cast_copies * block_numel(arch) if str(tr.mixed_precision) != "fp32" else 0
    chunk = min(tr.loss_chunk_size, s)
    logits_tmp = c.logits_extra_copies * b * chunk * arch.vocab_size * DTYPE_BYTES["float32"]
    return int((b * s * per_token + scores + weight_casts) * elt + logits_tmp)


def memory_table(config: AprConfig, coefficients: MemoryCoefficients = COEFFICIENTS) -> list[MemoryRow]:
    """Per-GPU bytes by component: buffer-plan sums, then the modelled rows."""
    sums: dict[str, list[int]] = {}
    for buf in buffer_plan(config):
        entry = sums.setdefault(buf.component, [0, 0])
        entry[0] += buf.nbytes
        entry[1] += 1
    rows = {name: MemoryRow(name, total, "buffer_plan", n, DESCRIPTIONS.get(name, "from the buffer plan"))
            for name, (total, n) in sums.items()}
    rows["block_activations"] = MemoryRow("block_activations", _block_activation_bytes(config, coefficients),
                                          "modelled", 0, DESCRIPTIONS["block_activations"])
    allocated = sum(r.bytes for r in rows.values())
    rows["cuda_context"] = MemoryRow("cuda_context", coefficients.cuda_context_bytes, "modelled", 0,
                                     DESCRIPTIONS["cuda_context"])
    rows["allocator_slack"] = MemoryRow("allocator_slack", int(allocated * coefficients.allocator_slack_fraction),
                                        "modelled", 0, DESCRIPTIONS["allocator_slack"])
    order = [c for c in _ORDER if c in rows] + [c for c in rows if c not in _ORDER]
    return [rows[c] for c in order]


def total_bytes(config: AprConfig, coefficients: MemoryCoefficients = COEFFICIENTS) -> int:
    return sum(r.bytes for r in memory_table(config, coefficients))


def with_batch_size(config: AprConfig, batch_size: int) -> AprConfig:
    return config.model_copy(update={"data": config.data.model_copy(update={"batch_size": batch_size})})


def max_micro_batch(config: AprConfig, vram_bytes: int, limit: int = 1 << 16,
                    coefficients: MemoryCoefficients = COEFFICIENTS) -> int:
    """The largest micro-batch (at this seq_len) whose total fits in ``vram_bytes``; 0 if none does."""

    def fits(b: int) -> bool:
        return total_bytes(with_batch_size(config, b), coefficients) <= vram_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):  # memory grows with the batch: gallop, then bisect
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def coefficients_dict(coefficients: MemoryCoefficients = COEFFICIENTS) -> dict:
    return asdict(coefficients)
