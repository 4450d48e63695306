"""The plan of a progressively stacked run (``model.stacking``): every stage's depth, steps,
parameters, memory, tokens and time, and the run's time as the sum of its stages. See
docs/design.md, "Progressive stacking"."""

from __future__ import annotations

from apr.config.schema import AprConfig
from apr.plan.gpus import Target
from apr.steps import stacking


def stacking_facts(config: AprConfig, total_steps: int, tokens_per_step: int, target: Target | None,
                   world_size: int, device_budget=None) -> dict:
    from apr.plan.facts import memory_facts, model_facts, time_estimate

    stages = []
    precision = str(config.training.mixed_precision)
    for st in stacking.stage_plan(config, total_steps):
        staged = stacking.config_at(config, st["first_step"])
        model = model_facts(staged)
        memory, _rows, choice = memory_facts(staged, target, device_budget)
        tokens = st["steps"] * tokens_per_step
        cost_f = choice.facts(staged).get("cost_f", 3.0)
        estimate = (time_estimate(tokens, model["flops_per_token"], target, precision, world_size,
                                  "the stage's steps", cost_f=cost_f) if tokens else None)
        stages.append({**st, "params": model["params"], "flops_per_token": model["flops_per_token"],
                       "tokens": tokens, "total_flops": tokens * model["flops_per_token"],
                       "memory_total_bytes": memory.get("total_bytes"),
                       "estimated_seconds": estimate["estimated_seconds"] if estimate else None})
    seconds = [s["estimated_seconds"] for s in stages]
    st = config.model.stacking
    return {"init": str(st.init), "earlier": str(st.earlier), "stages": stages,
            "total_flops": sum(s["total_flops"] for s in stages),
            "estimated_seconds": sum(seconds) if seconds and all(x is not None for x in seconds) else None,
            "peak_memory_bytes": max((s["memory_total_bytes"] or 0) for s in stages) if stages else None}
