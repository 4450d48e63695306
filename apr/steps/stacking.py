"""Progressive stacking's schedule: which depth the model has at a step (``model.stacking``).

Stage ``k`` of ``model.stacking.stages`` trains ``blocks`` decoder blocks for ``steps`` optimizer
steps; stage ``k`` covers steps ``start_k + 1 .. start_k + steps_k`` (1-based), the last stage runs
to the end. A checkpoint written at step ``s`` holds the depth of the stage that step belongs to
(step 0: the first stage), so the checkpoint manager, export and resume read the right shapes from
the config and the step alone. Torch-free. See docs/design.md, "Progressive stacking".
"""

from __future__ import annotations

from apr.config.schema import AprConfig, Architecture, StackingConfig


def _starts(stacking: StackingConfig | None) -> list[int]:
    if stacking is None:
        return [0]
    out, at = [], 0
    for st in stacking.stages:
        out.append(at)
        at += st.steps or 0
    return out


def _stage(stacking: StackingConfig | None, step: int) -> int:
    k = 0
    for i, s in enumerate(_starts(stacking)):
        if step > s:
            k = i
    return k


def starts(config: AprConfig) -> list[int]:
    """The step after which each stage starts (stage 0: 0)."""
    return _starts(config.model.stacking)


def stage_at(config: AprConfig, step: int) -> int:
    """The stage optimizer step ``step`` (1-based) trains in; the stage a checkpoint of ``step`` holds."""
    return _stage(config.model.stacking, step)


def stored_arch_at(model_doc: dict, step: int) -> Architecture:
    """:func:`arch_at` for a config as a checkpoint stores it (``config["model"]``, a JSON dict)."""
    arch = Architecture.model_validate(model_doc["architecture"])
    if not model_doc.get("stacking"):
        return arch
    stacking = StackingConfig.model_validate(model_doc["stacking"])
    depth = stacking.stages[_stage(stacking, step)].blocks
    return arch if depth == arch.num_hidden_layers else arch.model_copy(update={"num_hidden_layers": depth})


def depth_at(config: AprConfig, step: int) -> int:
    stacking = config.model.stacking
    if stacking is None:
        return config.model.architecture.num_hidden_layers
    return stacking.stages[stage_at(config, step)].blocks


def arch_at(config: AprConfig, step: int) -> Architecture:
    """The architecture at ``step``: the config's, at that stage's depth."""
    arch = config.model.architecture
    depth = depth_at(config, step)
    return arch if depth == arch.num_hidden_layers else arch.model_copy(update={"num_hidden_layers": depth})


def config_at(config: AprConfig, step: int) -> AprConfig:
    """The config at ``step``, as if its model always had that stage's depth (what the engine builds)."""
    depth = depth_at(config, step)
    if depth == config.model.architecture.num_hidden_layers:
        return config
    doc = config.model_dump(mode="json")
    doc["model"]["architecture"]["num_hidden_layers"] = depth
    doc["model"]["stacking"] = None
    return AprConfig.model_validate(doc)


def stage_plan(config: AprConfig, total_steps: int) -> list[dict]:
    """Every stage: its depth, first and last step (1-based) and step count over a run of ``total_steps``."""
    stacking = config.model.stacking
    if stacking is None:
        return []
    out = []
    s0 = starts(config)
    for i, st in enumerate(stacking.stages):
        end = total_steps if i == len(s0) - 1 else min(s0[i + 1], total_steps)
        out.append({"stage": i, "blocks": st.blocks, "first_step": s0[i] + 1, "end_step": end,
                    "steps": max(end - s0[i], 0)})
    return out
