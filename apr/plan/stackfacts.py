"""The plan of a progressively stacked run (``model.stacking``): every stage's depth, steps,
parameters, memory, tokens and time, and the run's time as the sum of its stages. See
docs/design.md, "Progressive stacking"."""

from __future__ import annotations

from apr.config.schema import AprConfig
from apr.model.spec import stack_bytes
from apr.steps import stacking


def stacking_facts(config: AprConfig, total_steps: int, tokens_per_step: int, stage_sheet) -> dict:
    """``stage_sheet(staged_config, tokens) -> (model facts, memory facts, time estimate or None)``:
    the plan's own facts of one stage's model (apr/plan/facts.py passes them in)."""
    stages = []
    for st in stacking.stage_plan(config, total_steps):
        staged = stacking.config_at(config, st["first_step"])
        tokens = st["steps"] * tokens_per_step
        model, memory, estimate = stage_sheet(staged, tokens)
        stages.append({**st, "params": model["params"], "flops_per_token": model["flops_per_token"],
                       "tokens": tokens, "total_flops": tokens * model["flops_per_token"],
                       "memory_total_bytes": memory.get("total_bytes"), "stacks": stack_bytes(staged),
                       "estimated_seconds": estimate["estimated_seconds"] if estimate else None})
    seconds = [s["estimated_seconds"] for s in stages]
    st = config.model.stacking
    return {"init": str(st.init), "earlier": str(st.earlier), "building_mode": str(st.building_mode),
            "trunk_strategy": str(st.trunk_strategy), "stages": stages,
            "total_flops": sum(s["total_flops"] for s in stages),
            "estimated_seconds": sum(seconds) if seconds and all(x is not None for x in seconds) else None,
            "peak_memory_bytes": max((s["memory_total_bytes"] or 0) for s in stages) if stages else None}
