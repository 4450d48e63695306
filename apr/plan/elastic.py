"""A resume on another number of ranks (docs/distributed.md, "Resuming on another number of ranks"):
the gradient accumulation that keeps the checkpoint's global batch, decided before the plan so the
plan sizes the run that will execute (``apr.apply._layout``, ``apr.plan.build.resolve_config``).
Torch-free: it reads the checkpoint's JSON only."""

from __future__ import annotations

from apr.checkpoint.manager import read_info, scan
from apr.config.schema import AprConfig
from apr.errors import AprError, Finding
from apr.steps.algebra import elastic_accumulation


def elastic_layout(config: AprConfig, run_dir, resume: str | None, world_size: int) -> dict | None:
    """Resuming on ``world_size`` ranks a checkpoint saved on another number: the gradient
    accumulation that keeps its global batch (``{"from_world_size", "to_world_size",
    "from_accumulation", "to_accumulation", "message"}``), None when the layout is the same or the
    checkpoint is unreadable (the resume reports that). Refused, naming the world sizes that can
    keep it, when none does."""
    if resume is None:
        return None
    try:
        if resume == "latest":
            found = [e for e in scan(run_dir) if e.complete]
            if not found:
                return None
            info = read_info(found[0].json_path)
        else:
            info = read_info(resume)
        saved_tr, saved_data = info.config["training"], info.config["data"]
        w0, a0 = int(saved_tr.get("world_size", 1)), int(saved_tr.get("gradient_accumulation", 1))
        b0 = int(saved_data["batch_size"])
    except (AprError, OSError, KeyError, TypeError, ValueError):
        return None
    if world_size == w0 or b0 != config.data.batch_size:
        return None  # same layout, or a batch_size change the config comparison refuses
    micro = a0 * w0  # micro-batches of batch_size rows per optimizer step, over all ranks
    accum, valid = elastic_accumulation(w0, a0, world_size)
    if accum is None:
        message = (f"{info.json_path} was saved by {w0} rank(s) x gradient_accumulation {a0}: a global batch of "
                   f"{micro} micro-batches of {b0} sequences, which {world_size} ranks cannot split evenly; resume on "
                   f"{', '.join(map(str, valid))} ranks (or change data.batch_size and pass --force)")
        raise AprError(message, [Finding("error", "resume.world_size", message, path="training.world_size",
                                         expected=f"a world size dividing {micro}", got=str(world_size))])
    return {"from_world_size": w0, "to_world_size": world_size, "from_accumulation": a0, "to_accumulation": accum,
            "message": f"resume: {w0} -> {world_size} ranks; gradient_accumulation {a0} -> {accum} keeps the global "
                       f"batch ({micro * b0} sequences per step)"}
