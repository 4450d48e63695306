"""``training.reduction: canonical`` checks and costs (docs/design.md, "Canonical reduction"). Torch-free:
`apr train validate` runs the checks.

Canonical reduction keeps every micro-batch's gradient apart and sums them in one fixed tree over the
global micro-batch index (apr/train/reduction.py); the orchestrator's rewards and distillation's
decisions read the step's loss that tree gives and the canonical validation loss. It is refused where a
part of the run sums over the ranks or the micro-batches in an order of its own, or reads what the
world size decides, with the layouts that work.
"""

from __future__ import annotations

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.fmt import fmt_seconds, format_bytes
from apr.memory.canonical import canonical_bytes
from apr.model.spec import trainable_param_count
from apr.steps.execution import gradient_source

# The rates canonical's time per step is modelled at (docs/performance.md, "Canonical reduction"): its
# memory copies (the leaves written, read by the tree and the sends, the mean written back) and the bytes
# it sends beyond fast. CPU: measured on the 2-core dev box, one torch thread a rank (2026-11-28: one
# process x 4 micro-batches spent 72-86 ms copying ~226 MB; gloo over loopback moved 1.1-1.2 GB/s in an
# all-reduce and an all-to-all). CUDA: not measured (no multi-GPU machine); assumed PCIe 4.0 x16 between
# the GPUs (NVLink is faster) and HBM-class copies.
COPY_BYTES_PER_S = {"cpu": 3e9, "cuda": 1e12}
LINK_BYTES_PER_S = {"cpu": 1e9, "cuda": 25e9}

WORKS = ("either gradient source (training.engine: standard, or interleaved with training.execution.gradients "
         "kept or auto) with training.sharding none (one process, DDP), full, hybrid or "
         "shard_grad_op (FSDP2), on any number of ranks, with or without training.orchestrator and "
         "training.mode: distill (its teacher's states computed each step: cache_teacher_outputs false)")


def reduction_problems(config) -> list[tuple[str, str]]:
    """What stops canonical from making this run's gradient sum, or what it reads, independent of the
    world size, and why: ``(the setting, the reason)`` pairs (empty: it can)."""
    tr = config.training
    out = []
    if gradient_source(config) == "interleaved" and str(tr.execution.gradients) == "workspace":
        out.append(("training.execution.gradients: workspace",
                    "training.execution.gradients: workspace updates each group inside the backward from one "
                    "shared gradient workspace; the fixed tree over the global micro-batches needs every "
                    "micro-batch's whole gradient before the first update (canonical keeps the walk's gradients: "
                    "kept or auto)"))
    lora = config.model.lora
    if config.model.architecture.dropout > 0 or (lora is not None and lora.dropout > 0):
        out.append(("dropout", "dropout (model.architecture.dropout, model.lora.dropout) draws each rank's masks "
                    "from that rank's own random state, so a micro-batch's masks depend on the rank that reads it"))
    if str(config.optimizer.name) == "swats" and str(tr.sharding) != "none":
        out.append(("optimizer.name: swats with training.sharding",
                    "optimizer.name: swats with training.sharding: SWATS's switch test sums its dot products "
                    "over the shards, in an order set by the number of shards"))
    if str(tr.mode) == "distill" and tr.distill.cache_teacher_outputs:
        out.append(("training.distill.cache_teacher_outputs",
                    "training.distill.cache_teacher_outputs: each rank caches the teacher's states of the rows "
                    "it read, so the world size decides which rows are read back from the cache (states computed "
                    "beside the other rows of an earlier micro-batch) and which are computed again beside the "
                    "rows of this one; the same bits both ways only where the teacher's forward of a row does not "
                    "depend on the rows computed with it, which nothing guarantees (the matrix products' blocking "
                    "runs over the whole micro-batch)"))
    return out


def reduction_findings(loaded: LoadedConfig, world_size: int | None = None) -> list[Finding]:
    """canonical where it cannot hold: an error at ``training.reduction`` naming the layouts that work;
    where it holds, an info line with its cost at ``world_size`` (default the config's)."""
    config = loaded.config
    if str(config.training.reduction) != "canonical":
        return []
    problems = reduction_problems(config)
    file, line, column = loaded.source.where(("training", "reduction"))
    if not problems:
        world = int(config.training.world_size if world_size is None else world_size)
        cost = reduction_cost(config, 4 * trainable_param_count(config), world)
        return [Finding("info", "config.reduction", cost["line"], path="training.reduction", file=file, line=line,
                        column=column)]
    got = ", ".join(what for what, _ in problems)
    return [Finding("error", "config.reduction", "training.reduction: canonical cannot make this run (its gradient "
                    "sum, or what it reads) independent of the world size: " + "; ".join(why for _, why in problems),
                    path="training.reduction", file=file, line=line, column=column,
                    expected=f"fast, or canonical with {WORKS}", got=f"canonical with {got}")]


def reduction_cost(config, param_bytes: int, world_size: int) -> dict:
    """What canonical costs beside fast, per rank and step (apr/memory/canonical.py), with its time per
    step modelled from its copies and the bytes it sends beyond fast at the device's rates."""
    cost = canonical_bytes(config, param_bytes, world_size)
    sharded = str(config.training.sharding) != "none"
    if world_size == 1:
        how = "no communication on one process"
    else:
        how = (f"{cost.all_to_alls} all-to-all(s) and an all-gather sending {format_bytes(cost.sent)} a step "
               f"where fast {'reduce-scatters' if sharded else 'all-reduces'} one gradient")
    device = "cpu" if str(config.training.device) == "cpu" else "cuda"
    beyond = max(0, cost.sent - cost.fast_sent)
    seconds = cost.copied / COPY_BYTES_PER_S[device] + beyond / LINK_BYTES_PER_S[device]
    rates = (f"{format_bytes(cost.copied)} copied at {COPY_BYTES_PER_S[device] / 1e9:g} GB/s"
             + (f", {format_bytes(beyond)} sent beyond fast at {LINK_BYTES_PER_S[device] / 1e9:g} GB/s"
                if world_size > 1 else ""))
    basis = "measured on a 2-core CPU" if device == "cpu" else "assumed: PCIe 4.0 x16 between GPUs, not measured"
    # the world sizes that keep the global batch (the elastic resume: a divisor of the global micro-batches,
    # each rank accumulating the rest) sum the same leaves in the same tree
    worlds = [w for w in range(1, cost.leaves + 1) if cost.leaves % w == 0]
    return {"reduction": "canonical", "leaves": cost.leaves, "extra_bytes": cost.extra, "gathered_bytes": cost.sent,
            "extra_seconds_per_step": seconds, "invariant_world_sizes": worlds,
            "line": f"canonical reduction: {cost.leaves} micro-batch gradients summed in one fixed tree "
                    f"(+{format_bytes(cost.extra)} per rank, the memory table's canonical_leaves; {how}; about "
                    f"+{fmt_seconds(seconds)} a step, modelled: {rates}, {basis}): bitwise the same on "
                    f"{_worlds(worlds)} rank(s), each accumulating {cost.leaves} / ranks micro-batches"}


def _worlds(worlds: list[int]) -> str:
    """1, 2, 4 or 8 (at most 8 named: 1, 2, 3, ... or 96)."""
    shown = worlds if len(worlds) <= 8 else [*worlds[:6], "...", worlds[-1]]
    words = [str(w) for w in shown]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def reduction_facts(config, world_size: int | None = None) -> dict | None:
    """The plan's ``reduction`` facts under canonical (``reduction_cost`` at ``world_size``, default the
    config's); None under fast or where canonical is refused."""
    if str(config.training.reduction) != "canonical" or reduction_problems(config):
        return None
    world = int(config.training.world_size if world_size is None else world_size)
    return reduction_cost(config, 4 * trainable_param_count(config), world)
