"""Progressive stacking in the run: the engine of a stage, and growing it into the next.

A stage's engine is the engine of the config at that stage's depth (``apr.steps.stacking``). At a
boundary the run builds the next stage's engine and fills it from the current one
(``grown_tensors``): the embedding, final norm and head carry over with their AdamW moments; each
block of the new stack takes a block of the old one, by ``model.stacking.init``:

- ``copy_top``: blocks ``0 .. old-1`` stay, each new block is a copy of the top one;
- ``interpolate``: block ``i`` is old block ``floor(i x old / new)`` (every block repeated in place);
- ``fresh``: blocks ``0 .. old-1`` stay, new blocks keep the new engine's random init (seeded by
  ``training.seed`` and the stage).

``building_mode: prepend`` puts the new blocks below the old ones (next to the embedding): old
block ``j`` becomes block ``new - old + j`` with its moments, and blocks ``0 .. new-old-1`` are the
new stack (``copy_top``: copies of the old top block with zero moments; ``fresh``: the new
engine's init). ``interpolate`` is refused with prepend (validate), since it moves every block.

A block's first copy keeps its moments; every other copy and every fresh block starts with zero
moments (AdamW's bias correction uses the run's step count, so a new block's first updates are
damped, like a short warmup). ``earlier: freeze`` freezes every block that existed before the
stage. See docs/design.md, "Progressive stacking".
"""

from __future__ import annotations

import re

import torch

from apr.checkpoint import names
from apr.config.schema import AprConfig
from apr.model import spec, trunk
from apr.steps import stacking
from apr.train import events
from apr.train.trunk_cache import trunk_cache_for

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ADAPTER = re.compile(r"\.lora_[AB](_s\d+)?$")  # a trunk adapter (``_s<k>``: the progressive one stage k added)


def sources(old_depth: int, new_depth: int, init: str, mode: str = "append") -> list[int | None]:
    """For each block of the new stack, the old block it copies (None: fresh)."""
    if mode == "prepend":  # the old blocks move up as a whole; the new stack sits below them
        added = new_depth - old_depth
        below = [old_depth - 1 if init == "copy_top" else None] * added
        return below + list(range(old_depth))
    if init == "interpolate":
        return [i * old_depth // new_depth for i in range(new_depth)]
    if init == "copy_top":
        return [i if i < old_depth else old_depth - 1 for i in range(new_depth)]
    return [i if i < old_depth else None for i in range(new_depth)]


def grown_tensors(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], old_depth: int, new_depth: int,
                  init: str, mode: str = "append", old_config: AprConfig | None = None) -> dict[str, torch.Tensor]:
    """The next stage's checkpoint tensors (weights and moments, by name) from the current stage's
    ``old`` and the freshly built next engine's ``new`` (for fresh blocks). ``old_config`` (the
    current stage's config) lets a trainable copy of an NF4 trunk block (prepend's ``copy_top``)
    take that block's dense weights: dequantized with its adapters folded in (``trunk.merged_weights``),
    the function the copied block computes."""
    src = sources(old_depth, new_depth, init, mode)
    merged: dict[str, torch.Tensor] = {}
    if mode == "prepend":  # each old block keeps its moments at its new place, above the new stack
        first = {j: new_depth - old_depth + j for j in range(old_depth)}
    else:  # each old block's first copy
        first = {s: i for i, s in reversed(list(enumerate(src))) if s is not None}
    out, quantized = {}, {}
    for name, fresh in new.items():
        moment = names.is_optimizer_state(name)
        param = name[len(names.OPT_M):] if moment else name
        m = _LAYER.match(param)
        if m is None:  # embedding, final norm, head: as they were
            out[name] = old[name]
            continue
        i, rest = int(m.group(1)), m.group(2)
        s = src[i]
        if s is None:  # a fresh block: the new engine's init, zero moments
            out[name] = torch.zeros_like(fresh) if moment else fresh.clone()
        elif moment and first[s] != i:  # a further copy starts its own optimizer state
            out[name] = torch.zeros_like(fresh)
        else:
            prefix = name[:len(name) - len(param)]
            source = f"{prefix}model.layers.{s}.{rest}"
            if source in old:
                out[name] = old[source]
            elif _ADAPTER.search(rest):  # a block entering the trunk, or a progressive adapter: new ones
                out[name] = torch.zeros_like(fresh) if moment else fresh.clone()
            elif ".nf4." in rest:  # a block entering an NF4 trunk: its float32 weight quantized once
                weight, _, part = rest.partition(".nf4.")
                if (s, weight) not in quantized:
                    quantized[s, weight] = trunk.stored_tensors(weight, old[f"model.layers.{s}.{weight}"], "nf4")
                out[name] = quantized[s, weight][f"{weight}.nf4.{part}"]
            elif old_config is not None and f"{source}.nf4.{spec.NF4_PARTS[0]}" in old and not moment:
                if not merged:  # a trainable copy of an NF4 trunk block: its weight as the block computes it
                    merged.update(trunk.merged_weights(old, old_config))
                out[name] = merged[source].to(fresh.dtype)
            else:
                raise KeyError(source)
    return out


def earlier_blocks(config: AprConfig, step: int) -> list[int]:
    """The blocks at ``step`` that existed before its stage (append: the bottom ones; prepend: the
    top ones), in order."""
    st = config.model.stacking
    k = 0 if st is None else stacking.stage_at(config, step)
    if k == 0:
        return []
    old, new = st.stages[k - 1].blocks, st.stages[k].blocks
    return list(range(new - old, new)) if str(st.building_mode) == "prepend" else list(range(old))


def frozen_groups(config: AprConfig, step: int) -> set[str]:
    """With ``earlier: freeze``, the blocks of earlier stages at ``step`` (``block.<i>`` groups)."""
    st = config.model.stacking
    if st is None or str(st.earlier) != "freeze" or stacking.trunk_storage(stacking.config_at(config, step)):
        return set()  # a transformed trunk is outside the optimizer groups (its adapters train)
    return {f"block.{i}" for i in earlier_blocks(config, step)}


def stage_parts(engine, config: AprConfig, step: int, run_dir, warn) -> None:
    """What a stage adds to its freshly built engine: ``earlier: freeze``'s frozen groups, and the
    trunk's activation cache (``cache_activations``)."""
    engine.freeze(frozen_groups(config, step))
    engine.trunk_cache = trunk_cache_for(engine, stacking.config_at(config, step), run_dir, warn)


def grow(run, step: int, recorder) -> None:
    """The engine of ``step``'s stage, filled from the run's current one (a collective under
    sharding: every rank gathers the whole state once per stage)."""
    old, old_depth = run.engine, len(run.engine.model.model.layers)
    meta = old.meta_state()
    before = {k: v.detach().clone() for k, v in old.train_state_tensors(everywhere=True).items()}
    del old

    def fill(engine) -> None:  # the grown blocks from the old stage's state, the new ones fresh
        fresh = engine.train_state_tensors(everywhere=True)
        engine.load_train_state_tensors(grown_tensors(before, fresh, old_depth, len(engine.model.model.layers),
                                                      str(run.config.model.stacking.init),
                                                      str(run.config.model.stacking.building_mode),
                                                      stacking.config_at(run.config, step - 1)))
        engine.load_meta_state(meta)

    run.rebuild_engine(step, fill)
    events.grown(run, step, old_depth, recorder)
