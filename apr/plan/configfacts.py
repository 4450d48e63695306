"""The facts that follow from the config alone (model shapes, memory against the target, the
execution strategy, MFU basis): what `apr train validate` evaluates the config-only contracts over,
and the first part of every plan's facts (``apr.plan.facts.all_facts``).

Kept apart from ``apr.plan.facts`` so that validate imports no data, tokenizer, storage, checkpoint
or calibration module: `apr train validate` runs in CI on every push (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.util import find_spec

from apr.config.schema import AprConfig
from apr.memory.activations import COEFFICIENTS
from apr.memory.buffers import state_bytes_per_param
from apr.memory.table import MAX_LAYERS_SEARCHED, MemoryRow, max_layers, max_micro_batch, memory_table
from apr.model.spec import (
    active_param_count,
    block_numel,
    expert_intermediate_size,
    flops_per_token,
    kv_cache_bytes_per_token,
    linear_dims,
    non_embedding_param_count,
    param_count,
    time_flops_per_token,
    time_param_specs,
    trainable_param_count,
)
from apr.plan.gpus import Target, mfu_basis
from apr.plan.memory import ExecutionChoice, choose_execution
from apr.steps.algebra import sequences_per_step
from apr.steps.strategy import step_strategy


@dataclass
class FactSheet:
    facts: dict
    memory: list[MemoryRow] = field(default_factory=list)
    time_estimate: dict | None = None


def base_facts(config: AprConfig, world_size: int) -> dict:
    """The facts ``config_facts`` starts from, without a target: the ranks, the model's shapes and
    the step's sequences and tokens. Without a target every memory, execution, MFU and target fact
    is moot for the contracts (they require the target's memory), so validate stops here."""
    per_step = sequences_per_step(config.data.batch_size, config.training.gradient_accumulation, world_size)
    return {
        "world_size": world_size,
        "model": model_facts(config),
        "schedule": {"sequences_per_step": per_step,
                     "tokens_per_step": per_step * config.data.seq_len,
                     "min_lr": config.optimizer.resolved_min_lr},
    }


def lora_facts(config: AprConfig) -> dict:
    """Adapter counts and the smallest dimension a rank must not exceed (spec.lora_block_specs)."""
    arch, lora = config.model.architecture, config.model.lora
    dims = {m: min(linear_dims(arch, m)) for m in lora.modules}
    smallest = min(dims, key=dims.__getitem__)
    return {"trainable_params": trainable_param_count(config), "frozen_params": param_count(arch),
            "scaling": lora.scaling, "modules": list(lora.modules), "min_dim": dims[smallest],
            "min_dim_module": smallest, "min_dim_shape": list(linear_dims(arch, smallest))}


def time_facts(config: AprConfig) -> dict:
    """``model.architecture.time``: its parameters (in the embedding's group) and FLOPs per token, and
    the step of each stacking stage (depth) or of validation and generation (input)."""
    from apr.model.timesteps import fixed_step_of, stage_step  # lazy: off validate's path unless the model has time

    arch, t, st = config.model.architecture, config.model.architecture.time, config.model.stacking
    depth = str(t.interpretation) == "depth"
    return {"interpretation": str(t.interpretation), "encoding": str(t.encoding), "embedding_dim": t.embedding_dim,
            "num_time_steps": t.num_time_steps, "params": sum(p.numel for p in time_param_specs(arch)),
            "flops_per_token": time_flops_per_token(arch, config.data.seq_len), "masking": t.masking,
            "stage_steps": [stage_step(t, k) for k in range(len(st.stages))] if depth and st else None,
            "eval_step": None if depth else fixed_step_of(config)}


def model_facts(config: AprConfig) -> dict:
    arch = config.model.architecture
    extra = {} if config.model.lora is None else {"lora": lora_facts(config)}
    if arch.moe is not None:  # the params a token uses; flops_per_token counts only those
        extra["moe"] = {"num_experts": arch.moe.num_experts, "top_k": arch.moe.top_k,
                        "expert_intermediate_size": expert_intermediate_size(arch),
                        "active_params": active_param_count(arch)}
    if arch.time is not None:  # time conditioning: counted with the embedding; the step outside training
        extra["time"] = time_facts(config)
    if arch.mla is not None:  # multi-head latent attention: the KV cache holds the latent and the RoPE key
        extra["mla"] = {"kv_lora_rank": arch.mla.kv_lora_rank, "qk_rope_head_dim": arch.mla.qk_rope_head_dim,
                        "q_lora_rank": arch.mla.q_lora_rank}
    return {
        **extra,
        "trainable_params": trainable_param_count(config),
        "params": param_count(arch),
        "non_embedding_params": non_embedding_param_count(arch),
        "block_params": block_numel(arch),
        "head_dim": arch.head_dim,
        "kv_heads": arch.kv_heads,
        "flops_per_token": flops_per_token(arch, config.data.seq_len),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(arch, 4),  # float32, as apr generate holds it
    }


def memory_facts(config: AprConfig, target: Target | None,
                 device_budget: tuple[int, str] | None = None) -> tuple[dict, list[MemoryRow], ExecutionChoice]:
    """Memory facts and rows under the execution policy the plan chooses, and that choice's facts.
    The budget: the target's memory, else ``device_budget`` (apply: the device's real memory)."""
    if target is not None and target.vram_bytes:
        budget: tuple[int | None, str | None] = (target.vram_bytes, target.source)
    else:
        budget = device_budget or (None, None)
    choice = choose_execution(config, *budget)
    rows = memory_table(config, execution=choice.execution)
    total = sum(r.bytes for r in rows)
    facts: dict = {"total_bytes": total, "by_component": {r.component: r.bytes for r in rows},
                   "calibrated": COEFFICIENTS.calibrated}
    if target is not None and target.vram_bytes:  # a zero size compares with nothing
        facts["vram_bytes"] = target.vram_bytes
        facts["usage_fraction"] = total / target.vram_bytes
        facts["max_micro_batch"] = max_micro_batch(config, target.vram_bytes)
    return facts, rows, choice


def mfu_facts(flops_per_tok: int, target: Target | None, precision: str, cost_f: float) -> dict:
    """What MFU and HFU are quoted against: the peak of the target GPU for the run's dtype (or why
    it is unknown: no fallback number), the model FLOPs per token (6N + attention, PaLM appendix B)
    and the hardware FLOPs per token (model FLOPs x the execution's ``cost_f / 3``: recompute and a
    norm-only pre-pass are work the GPU does that the model's FLOPs do not count)."""
    gpu = target.gpu if target is not None else None
    out = {**mfu_basis(gpu, precision, target.name if target is not None else None),
           "formula": "6N + 12 x layers x hidden x seq_len", "model_flops_per_token": flops_per_tok,
           "execution_cost_f": cost_f, "hardware_flops_per_token": flops_per_tok * cost_f / 3.0,
           "hfu_per_mfu": cost_f / 3.0}
    if out["known"]:
        out["assumed_mfu"] = gpu.mfu
        out["assumed_hfu"] = gpu.mfu * cost_f / 3.0
    return out


def execution_facts(config: AprConfig, execution=None) -> dict:
    """How apply will execute: engine, device, kernel backend, precision and clipping. Torch-free:
    ``auto`` choices are described, since they are made on the machine that applies."""

    tr = config.training
    st = step_strategy(config, execution)
    device, kernels = str(tr.device), str(tr.kernels)
    if kernels != "auto":
        kernels_resolved = kernels
    elif device == "cpu":
        kernels_resolved = "torch"
    else:
        kernels_resolved = "cupy if the device is CUDA and CuPy is available at apply time, else torch"
    device_resolved = "cuda if torch sees a CUDA device at apply time, else cpu" if device == "auto" else device
    return {
        "engine": st.engine, "device": device, "device_resolved": device_resolved, "kernels": kernels,
        "kernels_resolved": kernels_resolved, "cupy_installed_here": find_spec("cupy") is not None,
        "precision": str(tr.mixed_precision), "clip": st.clip, "keeps_all_grads": st.keeps_all_grads,
        "norm_prepass": st.norm_prepass, "backward_walks": st.backward_walks, "loss_scaling": st.loss_scaling,
        "strategy": st.describe(),
        # training.state_dtype: the weights' and AdamW moments' storage, bytes a parameter between steps
        "state_dtype": str(tr.state_dtype), "state_bytes_per_param": state_bytes_per_param(config),
    }


def config_facts(config: AprConfig, *, world_size: int, nodes: int | None = None, target: Target | None,
                 device_budget: tuple[int, str] | None = None) -> FactSheet:
    """Facts that need only the config (and the target): what `apr train validate` evaluates."""
    tr = config.training
    per_step = sequences_per_step(config.data.batch_size, tr.gradient_accumulation, world_size)
    facts: dict = {
        "world_size": world_size,
        "model": model_facts(config),
        "schedule": {"sequences_per_step": per_step,
                     "tokens_per_step": per_step * config.data.seq_len,
                     "min_lr": config.optimizer.resolved_min_lr},
    }
    if target is not None:
        facts["target"] = target.to_facts(str(tr.mixed_precision))
    # per rank at the planned number of ranks (--world-size): data parallelism's second gradient
    # workspace, the shards under training.sharding
    nodes = tr.nodes if nodes is None else nodes
    ranked = config if (tr.world_size, tr.nodes) == (world_size, nodes) else config.model_copy(
        update={"training": tr.model_copy(update={"world_size": world_size, "nodes": nodes})})
    facts["memory"], rows, choice = memory_facts(ranked, target, device_budget)
    if world_size > 1 and target is not None and target.vram_bytes:
        facts["sharding"] = sharding_facts(config, world_size, target, nodes)
    facts["execution"] = {**execution_facts(config, choice.execution), **choice.facts(config)}
    facts["mfu"] = mfu_facts(facts["model"]["flops_per_token"], target, str(tr.mixed_precision),
                             facts["execution"]["cost_f"])
    return FactSheet(facts=facts, memory=rows)


def sharding_facts(config: AprConfig, world_size: int, target: Target, nodes: int | None = None) -> dict:
    """Per-rank bytes under each sharding strategy at ``world_size`` ranks on ``nodes`` hosts
    (default training.nodes; hybrid only where they split evenly) with the config's engine, and
    which ones fit the target."""
    per_rank, max_batch, deepest = {}, {}, {}
    nodes = config.training.nodes if nodes is None else nodes
    hybrid = ("hybrid",) if nodes > 1 and world_size % nodes == 0 else ()
    for strategy in ("none", "shard_grad_op", "full", *hybrid):
        doc = config.model_dump(mode="json")
        doc["training"].update(world_size=world_size, nodes=nodes, sharding=strategy)
        ranked = AprConfig.model_validate(doc)
        mem = memory_facts(ranked, target)[0]
        per_rank[strategy] = mem["total_bytes"]
        max_batch[strategy] = mem.get("max_micro_batch")
        layers = max_layers(ranked, target.vram_bytes)
        deepest[strategy] = {"num_hidden_layers": layers, "at_least": layers >= MAX_LAYERS_SEARCHED,
                             "params": param_count(ranked.model.architecture.model_copy(
                                 update={"num_hidden_layers": layers})) if layers else 0}
    return {"world_size": world_size, "nodes": nodes, "strategy": str(config.training.sharding),
            "per_rank_bytes": per_rank,
            "fits": {k: v <= target.vram_bytes for k, v in per_rank.items()}, "max_micro_batch": max_batch,
            "largest_model": deepest}
