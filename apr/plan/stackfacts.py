"""The plan of a progressively stacked run (``model.stacking``): every stage's depth, steps,
parameters, memory, tokens and time, and the run's time as the sum of its stages. See
docs/design.md, "Progressive stacking"."""

from __future__ import annotations

from apr.config.schema import AprConfig
from apr.model.spec import block_numel, stack_bytes
from apr.steps import stacking


def _cache(staged: AprConfig, tokens: int, data_rows: int | None) -> dict | None:
    """``cache_activations`` in one stage: the cache's bytes on disk (one float32 row per training
    row the stage reads, up to the dataset's rows) and the trunk's forward FLOPs it saves (every
    row after its first visit reads the cache instead)."""
    blocks = stacking.cached_blocks(staged)
    if not blocks:
        return None
    arch, seq = staged.model.architecture, staged.data.seq_len
    rows = tokens // seq
    cached = min(rows, data_rows) if data_rows else rows
    trunk_flops = 2 * blocks * block_numel(arch) + 4 * blocks * arch.hidden_size * seq  # per token, forward
    return {"blocks": blocks, "rows": cached, "bytes": cached * seq * arch.hidden_size * 4,
            "saved_forward_flops": (rows - cached) * seq * trunk_flops}


def stacking_facts(config: AprConfig, total_steps: int, tokens_per_step: int, stage_sheet,
                   data_rows: int | None = None) -> dict:
    """``stage_sheet(staged_config, tokens) -> (model facts, memory facts, time estimate or None)``:
    the plan's own facts of one stage's model (apr/plan/facts.py passes them in); ``data_rows``: the
    training set's rows, where known (the activation cache's size)."""
    stages = []
    for st in stacking.stage_plan(config, total_steps):
        staged = stacking.config_at(config, st["first_step"])
        tokens = st["steps"] * tokens_per_step
        model, memory, estimate = stage_sheet(staged, tokens)
        stages.append({**st, "params": model["params"], "flops_per_token": model["flops_per_token"],
                       "tokens": tokens, "total_flops": tokens * model["flops_per_token"],
                       "memory_total_bytes": memory.get("total_bytes"), "stacks": stack_bytes(staged),
                       "activation_cache": _cache(staged, tokens, data_rows),
                       "estimated_seconds": estimate["estimated_seconds"] if estimate else None})
    seconds = [s["estimated_seconds"] for s in stages]
    st = config.model.stacking
    return {"init": str(st.init), "earlier": str(st.earlier), "building_mode": str(st.building_mode),
            "trunk_strategy": str(st.trunk_strategy), "stages": stages,
            "total_flops": sum(s["total_flops"] for s in stages),
            "estimated_seconds": sum(seconds) if seconds and all(x is not None for x in seconds) else None,
            "peak_memory_bytes": max((s["memory_total_bytes"] or 0) for s in stages) if stages else None}
