"""Layout keys a config may leave to the plan: ``auto`` (docs/plan.md, "auto keys").

``data.batch_size``, ``training.gradient_accumulation`` and ``training.sharding`` may say ``auto``:
the plan fits them (apr/plan/fit.py) and records the values it chose, which apply, a resume and a
sweep's trials then run. The loader takes each ``auto`` out before the schema sees the file
(``take_auto``), so a loaded config is always concrete; ``fill_auto`` puts in a stand-in that keeps
``data.global_batch_size`` (the micro-batch of 1 when both counts are auto, else the one the stated
count leaves), so step counts, tokens and the LR schedule are right before the fit. ``auto`` on any
other key is refused at the key by the schema (the loader names the keys that take it).
"""

from __future__ import annotations

from typing import Any

from apr.config.schema import AprConfig, Sharding
from apr.errors import ConfigError, Finding

BATCH, ACCUMULATION, SHARDING = "data.batch_size", "training.gradient_accumulation", "training.sharding"
FITTED_KEYS = (BATCH, ACCUMULATION, SHARDING)
# the keys that take auto in the schema itself: the plan decides them in its own facts
POLICY_KEYS = ("training.execution.activations", "training.execution.gradients", "training.execution.compile")
STAND_IN: dict[str, Any] = {BATCH: 1, ACCUMULATION: 1, SHARDING: Sharding.none.value}


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def take_auto(data: Any) -> tuple[Any, tuple[str, ...]]:
    """``data`` (parsed YAML, edited in place) with each fitted key's ``auto`` replaced by a stand-in,
    and those keys in FITTED_KEYS order."""
    autos = []
    for key in FITTED_KEYS:
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and is_auto(node.get(leaf)):
            node[leaf] = STAND_IN[key]
            autos.append(key)
    return data, tuple(autos)


def _nearest(total: int, step: int) -> str:
    below, above = total // step * step, (total // step + 1) * step
    return " or ".join(str(n) for n in (below, above) if n > 0)


def _error(source, key: str, message: str, expected: str, got: str) -> ConfigError:
    file, line, column = source.where(tuple(key.split(".")))
    return ConfigError(f"{file}: {key}: {message}", [Finding("error", "config.auto", message, path=key, file=file,
                                                             line=line, column=column, expected=expected, got=got)])


def fill_auto(config: AprConfig, autos: tuple[str, ...], source) -> AprConfig:
    """The config with the counts' stand-ins that keep ``data.global_batch_size`` at its world size;
    a global batch the stated counts do not make, or that none splits into, is refused at its key."""
    data, tr = config.data, config.training
    total, world = data.global_batch_size, tr.world_size
    counts = [k for k in (BATCH, ACCUMULATION) if k in autos]
    if not counts:
        made = data.batch_size * tr.gradient_accumulation * world
        if total is not None and total != made:
            raise _error(source, "data.global_batch_size",
                         f"{total} sequences per step, but data.batch_size {data.batch_size} x "
                         f"training.gradient_accumulation {tr.gradient_accumulation} x training.world_size {world} "
                         f"make {made}; set one of them to auto to let the plan fit it, or drop the key",
                         f"{made} (or null)", str(total))
        return config
    if total is None:
        raise _error(source, counts[0], "auto needs data.global_batch_size: the sequences per optimizer step over "
                     "all ranks that the plan's fit keeps", "data.global_batch_size set (e.g. 64)", "auto")
    fixed = {BATCH: data.batch_size, ACCUMULATION: tr.gradient_accumulation}
    step = world * (1 if len(counts) == 2 else fixed[BATCH if counts[0] == ACCUMULATION else ACCUMULATION])
    if total % step:
        stated = "" if len(counts) == 2 else (
            f" x {BATCH if counts[0] == ACCUMULATION else ACCUMULATION} {step // world}")
        raise _error(source, "data.global_batch_size",
                     f"{total} sequences per step cannot be split over training.world_size {world}{stated}: no "
                     f"micro-batch x accumulation gives each rank the same share; the nearest that can are "
                     f"{_nearest(total, step)}", f"a multiple of {step}", str(total))
    batch = 1 if BATCH in autos and len(counts) == 2 else (total // step if BATCH in autos else data.batch_size)
    accumulation = total // (batch * world)
    return config.model_copy(update={
        "data": data.model_copy(update={"batch_size": batch}),
        "training": tr.model_copy(update={"gradient_accumulation": accumulation})})


def auto_message(path: str) -> str:
    """What the loader says for ``auto`` on a key the plan does not fit."""
    keys = ", ".join([*FITTED_KEYS, *POLICY_KEYS])
    return f"auto is not a value {path} takes: the plan fits only {keys}"
