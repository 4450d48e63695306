"""The plan's choice of execution policy (``training.execution``): the fastest policy whose memory
(``apr.memory.table``) fits the budget, and what the alternatives would cost. The bytes themselves
are the memory package's (apr/memory/: the buffer plan, the modelled activations, the table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apr.config.schema import AprConfig
from apr.memory.activations import COEFFICIENTS, MemoryCoefficients
from apr.memory.table import total_bytes
from apr.steps import execution as policy
from apr.steps.execution import Execution, step_cost_f  # autograd's recompute is charged there (3F + recompute)


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
