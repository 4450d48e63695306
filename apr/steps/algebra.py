"""Step algebra: how many optimizer steps a config runs on a given amount of data.

``step_count`` is the one formula: the plan (``step_algebra``), the data loader and the run all
call it. The trainer runs exactly ``total_steps`` optimizer steps and drops the remainder of each
epoch that does not fill a whole step, so these formulas are the schedule, not an approximation of it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def sequences_per_step(batch_size: int, gradient_accumulation: int, world_size: int) -> int:
    """Rows one optimizer step consumes, over all micro-batches and data-parallel ranks."""
    return batch_size * gradient_accumulation * world_size


@dataclass(frozen=True)
class StepCount:
    num_sequences: int
    sequences_per_step: int
    steps_per_epoch: int  # floor(num_sequences / sequences_per_step): the remainder is dropped
    epoch_steps: int  # epochs * steps_per_epoch
    total_steps: int  # min(max_steps, epoch_steps); epoch_steps when max_steps is None

    @property
    def dropped_sequences_per_epoch(self) -> int:
        return self.num_sequences - self.steps_per_epoch * self.sequences_per_step


def step_count(*, num_sequences: int, batch_size: int, gradient_accumulation: int = 1, world_size: int = 1,
               epochs: int = 1, max_steps: int | None = None) -> StepCount:
    """The optimizer steps ``num_sequences`` rows give. Each epoch drops the rows that do not fill a
    whole step (a new shuffle picks other ones next epoch)."""
    per_step = sequences_per_step(batch_size, gradient_accumulation, world_size)
    per_epoch = num_sequences // per_step
    epoch_steps = epochs * per_epoch
    total = epoch_steps if max_steps is None else min(max_steps, epoch_steps)
    return StepCount(num_sequences, per_step, per_epoch, epoch_steps, total)


@dataclass(frozen=True)
class StepFacts:
    num_sequences: int  # training rows (each seq_len + 1 tokens)
    sequences_per_step: int  # batch_size * gradient_accumulation * world_size
    steps_per_epoch: int  # floor(num_sequences / sequences_per_step)
    epoch_steps: int  # epochs * steps_per_epoch: what the data can supply
    max_steps: int | None
    total_steps: int  # min(max_steps, epoch_steps); epoch_steps when max_steps is None
    epochs_run: float  # total_steps / steps_per_epoch (0 when an epoch holds no step)
    dropped_sequences_per_epoch: int  # rows that never fill a step
    tokens_per_step: int  # sequences_per_step * seq_len (predicted positions)
    total_tokens: int
    warmup_steps: int
    warmup_fraction: float  # warmup_steps / total_steps; warmup_steps / 1 when total_steps is 0
    save_interval: int
    checkpoints: int  # step checkpoints written during the run: total_steps // save_interval
    epochs_needed: int | None  # smallest epochs giving max_steps; None without max_steps or data
    sequences_needed: int | None  # smallest data size giving max_steps at these epochs

    def to_dict(self) -> dict:
        return asdict(self)


def step_algebra(
    *,
    num_sequences: int,
    batch_size: int,
    gradient_accumulation: int,
    world_size: int,
    epochs: int,
    max_steps: int | None,
    warmup_steps: int,
    save_interval: int,
    seq_len: int,
) -> StepFacts:
    """The step counts of a run and what follows from them (tokens, warmup share, checkpoints, the
    data or epochs ``max_steps`` needs). Pure integer arithmetic; all arguments are counts."""
    count = step_count(num_sequences=num_sequences, batch_size=batch_size,
                       gradient_accumulation=gradient_accumulation, world_size=world_size, epochs=epochs,
                       max_steps=max_steps)
    sequences_per_step, steps_per_epoch = count.sequences_per_step, count.steps_per_epoch
    total_steps = count.total_steps
    tokens_per_step = sequences_per_step * seq_len
    epochs_needed = sequences_needed = None
    if max_steps is not None:
        # epochs * floor(n / sps) >= max_steps  <=>  floor(n / sps) >= ceil(max_steps / epochs)
        sequences_needed = math.ceil(max_steps / epochs) * sequences_per_step
        if steps_per_epoch > 0:
            epochs_needed = math.ceil(max_steps / steps_per_epoch)
    return StepFacts(
        num_sequences=num_sequences,
        sequences_per_step=sequences_per_step,
        steps_per_epoch=steps_per_epoch,
        epoch_steps=count.epoch_steps,
        max_steps=max_steps,
        total_steps=total_steps,
        epochs_run=total_steps / steps_per_epoch if steps_per_epoch else 0.0,
        dropped_sequences_per_epoch=count.dropped_sequences_per_epoch,
        tokens_per_step=tokens_per_step,
        total_tokens=total_steps * tokens_per_step,
        warmup_steps=warmup_steps,
        warmup_fraction=warmup_steps / max(total_steps, 1),
        save_interval=save_interval,
        checkpoints=total_steps // save_interval,
        epochs_needed=epochs_needed,
        sequences_needed=sequences_needed,
    )


def elastic_accumulation(world_size: int, accumulation: int, new_world_size: int) -> tuple[int | None, list[int]]:
    """Resuming a run of ``world_size`` ranks x ``accumulation`` on ``new_world_size`` ranks with the
    same global batch: the new accumulation (None when the ranks cannot split the step's
    micro-batches evenly) and every world size that can (docs/distributed.md, "Resuming on another
    number of ranks")."""
    micro = accumulation * world_size  # micro-batches per optimizer step, over all ranks
    valid = [w for w in range(1, micro + 1) if micro % w == 0]
    return (micro // new_world_size if micro % new_world_size == 0 else None), valid
