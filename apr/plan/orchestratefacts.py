"""`training.orchestrator` and `optimizer.name` checks and the plan's orchestration facts
(docs/design.md, "Orchestrated training"). Torch-free: `apr train validate` runs the checks.

The facts: the decision points, the branches per decision (K), the extra optimizer steps they cost
(K - 1 horizons per decision: one branch is the run's own next steps), and the memory the exact
branches hold beside the engine (a copy of the decision point's state and one of the best branch
so far: weights + both moments, each the size of the engine's own; nowcasting's weight history).
"""

from __future__ import annotations

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.fmt import format_bytes
from apr.memory.table import MemoryRow, orchestrator_rows, state_bytes
from apr.steps import orchestration
from apr.steps.execution import gradient_source


def orchestrator_findings(loaded: LoadedConfig, total_steps: int | None) -> list[Finding]:
    """What the orchestrator (and the SGD / SWATS optimizers) cannot honour, at its key path."""
    config = loaded.config
    tr, orch = config.training, config.training.orchestrator
    out: list[Finding] = []

    def finding(key: tuple, message: str, expected: str, got: str, severity: str = "error") -> None:
        file, line, column = loaded.source.where(key)
        path = ".".join(f"[{k}]" if isinstance(k, int) else str(k) for k in key).replace(".[", "[")
        out.append(Finding(severity, "config.orchestrator" if key[:2] == ("training", "orchestrator")
                           else "config.optimizer", message, path=path, file=file, line=line, column=column,
                           expected=expected, got=got))

    optimizer = str(config.optimizer.name)
    if optimizer == "adafactor" and str(tr.sharding) != "none":
        finding(("optimizer", "name"), f"adafactor's row and column statistics average over whole rows and "
                f"columns of each matrix; under training.sharding: {tr.sharding} each rank holds some rows only",
                "adamw, or training.sharding: none", optimizer)
    elif optimizer == "adafactor" and gradient_source(config) == "interleaved":
        finding(("optimizer", "name"), "adafactor keeps row and column statistics of each weight matrix, but the "
                "flat-buffer walk (training.engine: interleaved) hands the updater each group's flat buffer, "
                "without the matrices' shapes", "training.engine: standard, or another optimizer",
                f"adafactor with training.engine: {tr.engine}")
    defaults = type(config.optimizer).model_fields
    # a key changed from its default (a run's saved config.yaml states every key at its default value)
    changed = [k for k in sorted(config.optimizer.model_fields_set) if k.startswith("adafactor_")
               and getattr(config.optimizer, k) != defaults[k].default]
    for key in changed:
        if optimizer != "adafactor":  # accepted, then ignored, would be silent
            finding(("optimizer", key), f"optimizer.{key} applies to adafactor only; the run's optimizer is "
                    f"{optimizer}", "optimizer.name: adafactor, or no adafactor_ keys", f"{key} with {optimizer}")
    if not orch.enabled:
        return out
    if str(config.optimizer.name) != "adamw":
        finding(("optimizer", "name"), "with training.orchestrator the strategies choose the optimizer (adamw or "
                "sgd each); the run's optimizer must be adamw", "adamw", str(config.optimizer.name))
    known = orchestration.strategy_table(config)
    names = sorted(known)
    for key in ("initial_strategy", "safety_strategy"):
        value = getattr(orch, key)
        if value not in known:
            finding(("training", "orchestrator", key), f"unknown strategy {value!r}", "one of " + ", ".join(names),
                    repr(value))
    for i, name in enumerate(orch.candidates or []):
        if name not in known:
            finding(("training", "orchestrator", "candidates", i), f"unknown strategy {name!r}",
                    "one of " + ", ".join(names), repr(name))
    if orch.candidates is not None and not orch.candidates:
        finding(("training", "orchestrator", "candidates"), "no candidate strategy to choose among",
                "at least one strategy name", "[]")
    if orch.eval_horizon > orch.decision_interval:
        finding(("training", "orchestrator", "eval_horizon"),
                f"eval_horizon {orch.eval_horizon} is longer than decision_interval {orch.decision_interval}: the "
                "next decision would fall inside the branches", f"<= {orch.decision_interval}",
                str(orch.eval_horizon))
    used = {n for n in [orch.initial_strategy, orch.safety_strategy, *orchestration.candidates(config)] if n in known}
    for name in sorted(used):
        s = orchestration.resolve(config, name)
        where = (("training", "orchestrator", "strategies", name) if name in orch.strategies
                 else ("training", "orchestrator", "candidates"))
        if s.clip_mode == "adagc" and str(tr.clip_mode) != "adagc":
            finding((*where, "clip_mode") if name in orch.strategies else where,
                    f"strategy {name} clips with AdaGC, whose per-tensor EMAs the engine allocates only with "
                    "training.clip_mode: adagc", "training.clip_mode: adagc, or another clip_mode",
                    f"training.clip_mode: {tr.clip_mode}")
    if config.model.stacking is not None:
        finding(("training", "orchestrator", "enabled"), "orchestration and model.stacking both change the "
                "engine during the run (stacking rebuilds it)", "one of them", "both")
    if config.data.val is None and not any(s.val for s in config.data.sources or []):
        finding(("training", "orchestrator", "enabled"), "the orchestrator scores strategies on validation "
                "batches, but the config has no validation data", "data.val set", "no data.val")
    elif tr.eval_interval == 0:
        finding(("training", "orchestrator", "enabled"), "the orchestrator scores strategies on validation "
                "batches, but training.eval_interval: 0 turns validation off", "training.eval_interval > 0", "0")
    if total_steps is not None and orch.decision_interval >= total_steps:
        finding(("training", "orchestrator", "decision_interval"),
                f"decision_interval {orch.decision_interval} is not shorter than the run ({total_steps} steps): "
                "no decision is ever made", f"< {total_steps}", str(orch.decision_interval), "warning")
    return out


def orchestrator_facts(config, total_steps: int | None, memory: dict | None) -> dict | None:
    """The plan's orchestration row: decisions, K, the extra steps and the extra memory; None when
    orchestration is off."""
    orch = config.training.orchestrator
    if not orch.enabled or total_steps is None:
        return None
    facts = orchestration.overhead(config, total_steps)
    by = (memory or {}).get("by_component") or {}
    state = state_bytes(by)
    weights = int(by.get("weights") or 0)
    copies = (2 if facts["branches"] > 1 else 1) if orch.max_loss_increase is not None or facts["branches"] > 1 else 0
    facts["state_copies"] = copies
    facts["nowcast_copies"] = orch.nowcasting.history if orch.nowcasting.enabled else 0
    facts["extra_bytes"] = copies * state + facts["nowcast_copies"] * weights
    sgd = [n for n in orchestration.candidates(config) if orchestration.resolve(config, n).optimizer == "sgd"]
    facts["sgd_strategies"] = sgd  # their momentum is AdamW's first-moment buffer: no extra memory
    return facts


def orchestrator_memory_rows(facts: dict, memory: dict | None) -> list[MemoryRow]:
    """The plan's memory rows for the orchestrator's copies (apr.memory.table)."""
    return orchestrator_rows(facts["state_copies"], facts["nowcast_copies"], (memory or {}).get("by_component") or {})


def orchestrator_memory_findings(loaded: LoadedConfig, facts: dict | None, memory: dict | None) -> list[Finding]:
    """The branches' state copies must fit the memory budget with the engine (``memory``: the plan's
    totals, the copies' rows included)."""
    if not facts or not memory or not memory.get("vram_bytes"):
        return []
    total, budget = memory["total_bytes"], memory["vram_bytes"]
    if total <= budget:
        return []
    key = ("training", "orchestrator", "branches") if facts["branches"] > 1 else ("training", "orchestrator",
                                                                                  "max_loss_increase")
    file, line, column = loaded.source.where(key)
    return [Finding("error", "config.orchestrator", f"the orchestrator's state copies ({facts['state_copies']} x "
                    f"weights + moments, {facts['nowcast_copies']} nowcast weight copies: "
                    f"{format_bytes(facts['extra_bytes'])}) do not fit beside the run's "
                    f"{format_bytes(total - facts['extra_bytes'])} in {format_bytes(budget)}",
                    path=".".join(key), file=file, line=line, column=column,
                    expected=f"<= {format_bytes(budget)} in all", got=format_bytes(total))]
