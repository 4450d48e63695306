"""The names of the tensors in a checkpoint, and the one check that a set of tensors is a model's.

A checkpoint holds each parameter under its Hugging Face Llama name and its AdamW moments under
``optimizer.m.<name>`` and ``optimizer.v.<name>``, all float32 (all bfloat16 with
``training.state_dtype: bf16``: the stored state as the run holds it). The engines, the checkpoint manager
and export spell these names only through this module (see docs/design.md, "Checkpoints").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

OPTIMIZER_PREFIX = "optimizer."
OPT_M = "optimizer.m."  # AdamW first moment of a parameter
OPT_V = "optimizer.v."  # AdamW second moment
STORED_DTYPE = "float32"
STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # training.state_dtype -> its checkpoints' tensors
# trained parameters of a loss part, not of the model (a narrower distillation student's projections,
# apr/train/distill.py): under the optimizer prefix, so every reader of the model's weights (export,
# weights_only loads, imports) leaves them, as it leaves the moments; the checkpoint's JSON lists
# them with their shapes under ``loss_tensors`` (``loss_state_shapes``)
LOSS_PREFIX = OPTIMIZER_PREFIX + "loss."
DISTILL_DOWN = LOSS_PREFIX + "distill.down"  # [student hidden, teacher hidden]: teacher state -> student
DISTILL_UP = LOSS_PREFIX + "distill.up"  # [teacher hidden, student hidden]: student output -> teacher


def moment_names(param: str) -> tuple[str, str]:
    """(first-moment name, second-moment name) of a parameter."""
    return OPT_M + param, OPT_V + param


def is_optimizer_state(name: str) -> bool:
    return name.startswith(OPTIMIZER_PREFIX)


def state_shapes(params: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of these (name, shape) parameters holds: the
    weights, then the first moments, then the second moments."""
    params = [(n, tuple(s)) for n, s in params]
    out = dict(params)
    out.update((OPT_M + n, s) for n, s in params)
    out.update((OPT_V + n, s) for n, s in params)
    return out


def loss_state_shapes(doc: Mapping) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the loss parts' tensors (with moments) a checkpoint's JSON (or a TrainState's
    meta) lists under ``loss_tensors``; ValueError for a listing apr would not write."""
    listed = doc.get("loss_tensors") or {}
    if not isinstance(listed, Mapping):
        raise ValueError("loss_tensors must be a name -> shape mapping")
    for name, shape in listed.items():
        if not (isinstance(name, str) and name.startswith(LOSS_PREFIX) and isinstance(shape, list | tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
            raise ValueError(f"loss_tensors: {name!r} -> {shape!r} is not a {LOSS_PREFIX}* name and a shape")
    return state_shapes((n, tuple(s)) for n, s in listed.items())


def expected_tensors(arch, lora=None) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of this model (an ``Architecture``) holds; with
    ``lora`` (a LoraConfig) only the adapters (the frozen base is referenced, not stored)."""
    from apr.model.spec import lora_block_specs, param_specs

    if lora is not None:
        return state_shapes((p.name, p.shape) for i in range(arch.num_hidden_layers)
                            for p in lora_block_specs(arch, lora, i))
    return state_shapes((p.name, p.shape) for p in param_specs(arch))


def stage_tensors(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a checkpoint of one stacking stage's config (``apr.steps.stacking.config_at``)
    whose trunk is transformed: the optimizer groups with their moments, the frozen trunk without."""
    from apr.model.spec import optimizer_groups, trunk_specs

    out = state_shapes((p.name, p.shape) for _, specs in optimizer_groups(config) for p in specs)
    out.update((n, tuple(s)) for n, s in trunk_specs(config))
    return out


def stored_dtype(config) -> str:
    """The dtype of every tensor in the checkpoints of ``config`` (an AprConfig, or the dict a
    checkpoint's JSON stores): ``training.state_dtype``'s, float32 for configs older than the key."""
    if isinstance(config, Mapping):
        name = (config.get("training") or {}).get("state_dtype", "fp32")
    else:
        name = config.training.state_dtype
    return STATE_DTYPES.get(str(name), STORED_DTYPE)


def tensor_mismatches(shapes: Mapping[str, Iterable[int]], dtypes: Mapping[str, str],
                      want: Mapping[str, tuple[int, ...]], stored: str | None = None) -> list[str]:
    """Human-readable differences between the tensors present (name -> shape, name -> dtype name)
    and those wanted: missing, unexpected, wrong shape, not ``stored`` (``stored_dtype``; None: any
    dtype a checkpoint may hold, float32 or bfloat16). Empty when they match."""
    problems = []
    missing = [n for n in want if n not in shapes]
    extra = sorted(n for n in shapes if n not in want)
    if missing:
        problems.append(f"missing {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s), e.g. {', '.join(extra[:3])}")
    for name, shape in want.items():
        if name in shapes and tuple(shapes[name]) != tuple(shape):
            problems.append(f"{name} has shape {list(shapes[name])}, the model needs {list(shape)}")
        if name in dtypes and dtypes[name] != stored and (stored or dtypes[name] not in STATE_DTYPES.values()):
            held = stored or " or ".join(STATE_DTYPES.values())
            problems.append(f"{name} is {dtypes[name]}, checkpoints hold {held}"
                            + (" (training.state_dtype)" if stored and stored != STORED_DTYPE else ""))
    return problems


def torch_mismatches(tensors: Mapping[str, object], want: Mapping[str, tuple[int, ...]],
                     stored: str | None = None) -> list[str]:
    """:func:`tensor_mismatches` for a dict of torch tensors."""
    return tensor_mismatches({n: tuple(t.shape) for n, t in tensors.items()},
                             {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()}, want, stored)
