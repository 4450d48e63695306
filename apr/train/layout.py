"""The run's layout: its device, its ranks, and a resume on another number of ranks (docs/distributed.md,
"Resuming on another number of ranks").

``apr train apply`` decides the layout before it plans (``apr.plan.elastic.elastic_layout`` on the
newest or named checkpoint), so the plan sizes the run that will execute: the world size torchrun started and the
gradient accumulation that keeps the checkpoint's global batch. The run receives the config laid out
(``apr.steps.resolved.resolve``) and changes nothing.
"""

from __future__ import annotations

import torch

from apr.data.loader import ShardLoader
from apr.errors import AprError, Finding
from apr.steps.resolved import Resolved
from apr.train.dist import DataParallel, from_env
from apr.train.engine import resolve_device


def device_and_ranks(plan: Resolved) -> tuple[torch.device, DataParallel | None]:
    """The device ``training.device`` names and, under torchrun, the process group: the world size
    the plan was made for, or an error (a saved plan run by another number of ranks)."""
    device = resolve_device(str(plan.config.training.device))
    dp = from_env(device.type)
    world = 1 if dp is None else dp.world_size
    if world != plan.world_size:
        message = (f"the plan was made for {plan.world_size} rank(s) but {world} started; plan again at this "
                   f"world size (apply plans at the world size torchrun starts)")
        raise AprError(message, [Finding("error", "apply.world_size", message, path="training.world_size",
                                         expected=str(plan.world_size), got=str(world))])
    if dp is not None and device.type == "cuda":
        device = torch.device("cuda", dp.local_rank)
    return device, dp


def elastic_cursor(saved: dict, loader, elastic: dict | None) -> dict:
    """A saved single-source cursor of another world size, at the same global row: ``position``
    counts micro-batches of batch_size x world_size rows, so it scales by the world sizes."""
    if saved.get("kind") == "mixture" or not isinstance(loader, ShardLoader):
        return saved  # a mixture's cursor counts global draws: valid at any world size
    w0, w1 = int(saved.get("world_size", 1)), loader.world_size
    if w0 == w1 or elastic is None:
        return saved
    rows = int(saved["position"]) * w0
    if rows % w1:
        return saved  # not at a step boundary of the new layout: load_state_dict refuses it
    return {**saved, "position": rows // w1, "world_size": w1, "gradient_accumulation": loader.gradient_accumulation}


def remap_cursor(loader, saved: dict, mixture: bool, accumulation: int) -> str:
    """A forced resume whose data layout changed (rows, batch, accumulation, ranks, seed or shuffle):
    keep the saved epoch and the fraction of it already read, at the new layout. Not exact; returns
    the warning that says so."""
    if mixture:  # the same number of rows drawn, under the new layout and stages
        draws = int((saved.get("cursor") or {}).get("draws", 0))
        loader.seek(draws // loader.rows_per_micro)
        return (f"the data mixture or layout changed since the checkpoint; the data cursor was re-mapped to "
                f"micro-batch {loader.absolute} (the run is no longer exactly reproducible)")
    ga = int(saved.get("gradient_accumulation", 1))
    per_step = int(saved.get("batch_size", 1)) * ga * int(saved.get("world_size", 1))
    old_micro_batches = int(saved.get("num_rows", 0)) // max(per_step, 1) * ga
    done = int(saved.get("position", 0)) / max(old_micro_batches, 1)
    position = min(int(done * loader.micro_batches_per_epoch) // accumulation * accumulation,
                   loader.micro_batches_per_epoch)
    loader.load_state_dict({"epoch": int(saved.get("epoch", 0)), "position": position})
    return (f"the data layout changed since the checkpoint; the data cursor was re-mapped to epoch "
            f"{loader.epoch}, micro-batch {position} of {loader.micro_batches_per_epoch} "
            "(the run is no longer exactly reproducible)")
