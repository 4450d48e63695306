"""What exact global-norm clipping costs when gradients are not kept: the plan says so when a run
asks for it, with the alternatives that cost less. Torch-free.
docs/design.md, "Lean mode with exact global clipping"."""

from __future__ import annotations

from apr.config.schema import AprConfig
from apr.errors import Finding
from apr.fmt import fmt_ratio
from apr.steps import execution as policy
from apr.steps.execution import Execution

PLAIN_F = 3.0  # a plain loop's step: forward 1F + backward 2F


def best_workspace_cost(config: AprConfig) -> float:
    """The cheapest step, in F, of any activations policy with one gradient workspace under this
    config's clipping: ``keep`` (the pre-pass backpropagates the kept graphs again, 5F)."""
    ex = config.training.execution
    free = config.model_copy(update={"training": config.training.model_copy(update={"execution": ex.model_copy(
        update={"activations": "auto", "gradients": "workspace"})})})
    return min(policy.step_cost_f(free, e) for e in policy.candidates(free))


def exact_clip_findings(loaded, execution: Execution) -> list[Finding]:
    """An info finding when the chosen policy runs a norm-only pre-pass for exact global clipping:
    its cost against a plain loop, the best an exact schedule at one workspace can do, and why."""
    config = loaded.config
    if not policy.needs_prepass(config, execution) or "global norm" not in policy.prepass_reasons(config):
        return []
    cost, best = policy.step_cost_f(config, execution), best_workspace_cost(config)
    message = (f"exact global-norm clipping with one gradient workspace runs a norm-only backward walk before "
               f"the update walk: {policy.fmt_f(cost)} a step against a plain loop's 3F "
               f"({fmt_ratio(PLAIN_F / cost)} its throughput at best); no exact schedule at one workspace's "
               f"gradient memory costs less than "
               f"{policy.fmt_f(best)} ({fmt_ratio(PLAIN_F / best)}, activations keep), because the norm needs every "
               f"gradient before the first update and a gradient that is not kept must be computed again (a second "
               f"backward, 2F); for more, keep the gradients (training.execution.gradients: kept, 3F) or clip "
               f"without the global norm (training.clip_mode: adagc or per_block, one walk)")
    file, line, column = loaded.source.where(("training", "clip_mode"))
    return [Finding("info", "plan.exact_clip_cost", message, path="training.clip_mode", file=file, line=line,
                    column=column, expected="a step within 0.85x of a plain loop's",
                    got=f"{policy.fmt_f(cost)} ({fmt_ratio(PLAIN_F / cost)})")]
