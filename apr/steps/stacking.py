"""Progressive stacking's schedule: which depth the model has at a step (``model.stacking``).

Stage ``k`` of ``model.stacking.stages`` trains ``blocks`` decoder blocks for ``steps`` optimizer
steps; stage ``k`` covers steps ``start_k + 1 .. start_k + steps_k`` (1-based), the last stage runs
to the end. A checkpoint written at step ``s`` holds the depth of the stage that step belongs to
(step 0: the first stage), so the checkpoint manager, export and resume read the right shapes from
the config and the step alone. Torch-free. See docs/design.md, "Progressive stacking".
"""

from __future__ import annotations

from apr.config.schema import AprConfig, Architecture, LoraConfig, StackingConfig

# StackWise's QLoRA defaults (qlora_rank 16, qlora_alpha 32), on every projection of the trunk
QLORA_DEFAULT = {"rank": 16, "alpha": 32.0, "targets": "all"}


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
    """The config at ``step``, as if its model always had that stage's depth (what the engine builds).
    Its stacking keeps the stages up to that one (the last running to the end), so that the config
    alone says which blocks are the trunk and how it is stored (:func:`trunk_storage`)."""
    depth = depth_at(config, step)
    if depth == config.model.architecture.num_hidden_layers:
        return config
    doc = config.model_dump(mode="json")
    doc["model"]["architecture"]["num_hidden_layers"] = depth
    stages = doc["model"]["stacking"]["stages"][:stage_at(config, step) + 1]
    stages[-1]["steps"] = None
    doc["model"]["stacking"]["stages"] = stages
    if trunk_transformed(config.model.stacking):  # every stage on the source the plan chose for the run
        doc["training"]["engine"] = "standard"
    return AprConfig.model_validate(doc)


def _origins(stacking: StackingConfig, k: int) -> list[int]:
    """At stage ``k``, the stage that added each block (append: from the bottom; prepend: from the top)."""
    blocks = [st.blocks for st in stacking.stages[:k + 1]]
    from_edge = [next(i for i, b in enumerate(blocks) if d < b) for d in range(blocks[-1])]
    return from_edge[::-1] if str(stacking.building_mode) == "prepend" else from_edge


def block_origins(config: AprConfig) -> list[int]:
    """The stage that added each block of the config's last stage (no stacking: all stage 0)."""
    st = config.model.stacking
    if st is None:
        return [0] * config.model.architecture.num_hidden_layers
    return _origins(st, len(st.stages) - 1)


def trunk_transformed(stacking: StackingConfig | None) -> bool:
    """Whether frozen earlier blocks are stored otherwise than in float32 or carry adapters: then
    they leave the optimizer groups (the plan runs such a run on autograd)."""
    if stacking is None or str(stacking.earlier) != "freeze":
        return False
    return (stacking.trunk_lora is not None or str(stacking.trunk_strategy) == "qlora" or stacking.freeze_embedding
            or any(str(st.precision) != "fp32" for st in stacking.stages[:-1]))


def embedding_frozen(config: AprConfig) -> bool:
    """``freeze_embedding`` at the config's last stage (from stage 1 on): the embedding is trunk too."""
    st = config.model.stacking
    return bool(trunk_storage(config)) and st.freeze_embedding


def cached_blocks(config: AprConfig) -> int:
    """With ``cache_activations`` at the config's last stage: how many bottom blocks (the trunk)
    the cache stands for; 0 without a cache."""
    st = config.model.stacking
    if st is None or not st.cache_activations or not embedding_frozen(config):
        return 0
    return len(trunk_storage(config))


def trunk_storage(config: AprConfig) -> dict[int, str]:
    """Block -> storage of its projections (fp32, fp16, bf16, nf4) for every trunk block of the
    config's last stage (the stage ``config_at`` describes), when the trunk is transformed."""
    st = config.model.stacking
    if not trunk_transformed(st):
        return {}
    k = len(st.stages) - 1
    qlora = str(st.trunk_strategy) == "qlora"
    return {b: "nf4" if qlora else str(st.stages[o].precision) for b, o in enumerate(_origins(st, k)) if o < k}


def trunk_adapters(config: AprConfig) -> LoraConfig | None:
    """The adapters trunk blocks carry: ``trunk_lora``, or qlora's StackWise defaults."""
    st = config.model.stacking
    if st is None or not trunk_transformed(st):
        return None
    if st.trunk_lora is not None:
        return st.trunk_lora
    return LoraConfig.model_validate(QLORA_DEFAULT) if str(st.trunk_strategy) == "qlora" else None


def stage_adapters(config: AprConfig, stage: int, floor: bool = True) -> tuple[int, float] | None:
    """The (rank, alpha) of the trunk adapters the blocks ``stage`` added carry: the trunk adapters'
    own, grown by ``adapter_pattern`` (x 2^stage, or / 2^stage: validate refuses a rank below 1, and
    ``floor`` keeps the plan's arithmetic at 1 meanwhile), and replaced by ``stages[stage].adapters``
    where that sets them; None without adapters."""
    base, st = trunk_adapters(config), config.model.stacking
    if base is None:
        return None
    rank, alpha = base.rank, base.alpha
    if st.adapter_pattern is not None:
        grow = {"constant": 1.0, "increasing": 2.0 ** stage, "decreasing": 0.5 ** stage}
        rank = int(rank * grow[str(st.adapter_pattern.rank)])
        alpha = alpha * grow[str(st.adapter_pattern.alpha)]
    own = st.stages[stage].adapters if stage < len(st.stages) else None
    if own is not None:
        rank, alpha = own.rank or rank, own.alpha or alpha
    return (max(rank, 1) if floor else rank), alpha


def block_adapters(config: AprConfig, block: int) -> LoraConfig | None:
    """Trunk block ``block``'s own adapters: ``trunk_adapters`` at the rank and alpha of the stage
    that added it (``stage_adapters``)."""
    base, st = trunk_adapters(config), config.model.stacking
    if base is None or (st.adapter_pattern is None and not any(s.adapters for s in st.stages)):
        return base
    rank, alpha = stage_adapters(config, _origins(st, len(st.stages) - 1)[block])
    return base.model_copy(update={"rank": rank, "alpha": alpha})


def progressive_stages(config: AprConfig) -> dict[int, tuple[int, ...]]:
    """Block -> the stages whose grow gave it a progressive adapter (``progressive_lora``), at the
    config's last stage: a block added by stage ``o`` joins the trunk with its adapters at stage
    ``o + 1`` and gets one more at each stage after that. Blocks without any: absent."""
    st = config.model.stacking
    if st is None or st.progressive_lora is None or trunk_adapters(config) is None:
        return {}
    k = len(st.stages) - 1
    out = {b: tuple(range(o + 2, k + 1)) for b, o in enumerate(_origins(st, k)) if o + 2 <= k}
    return {b: stages for b, stages in out.items() if b in trunk_storage(config)}


def stored_config_at(doc: dict, step: int) -> AprConfig:
    """:func:`config_at` for a config as a checkpoint stores it (a JSON dict)."""
    return config_at(AprConfig.model_validate(doc), step)


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
