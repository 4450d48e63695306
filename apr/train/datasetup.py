"""The run's data side, set up from the config: the training loader (one source or a mixture), the
step count (the plan's formula, ``apr.steps.algebra.step_count``), the LR schedule and the cadence;
and each step's micro-batches (``micro_batches``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from apr.data.loader import ShardLoader
from apr.data.mixconfig import decay_start_step, token_stages
from apr.data.mixloader import MixtureLoader
from apr.errors import AprError, Finding
from apr.steps.algebra import step_count
from apr.steps.schedule import LRSchedule


@dataclass
class DataSide:
    loader: ShardLoader | MixtureLoader
    mixture: bool
    loader_options: dict  # what a validation loader needs to read rows alike
    epoch_steps: int
    total_steps: int
    tokens_per_step: int
    schedule: LRSchedule


def micro_batches(loader, count: int, pin: bool) -> list:
    """The next optimizer step's ``count`` micro-batches. ``pin`` (a CUDA run): in page-locked host
    memory, so the engine's ``batch.to(device, non_blocking=True)`` is a copy queued on the stream; from
    pageable memory CUDA synchronizes the stream before the copy, a host wait for the previous step
    at every step."""
    batches = [loader.next_batch() for _ in range(count)]
    return [b.pin_memory() for b in batches] if pin else batches


def data_side(config, dp, warn) -> DataSide:
    tr, data = config.training, config.data
    rank, world = (0, 1) if dp is None else (dp.rank, dp.world_size)
    options = dict(seq_len=data.seq_len, batch_size=data.batch_size, seed=tr.seed, world_size=world, rank=rank,
                   input_column=data.input_column, vocab_size=config.model.architecture.vocab_size, on_warning=warn)
    mixture = data.sources is not None
    if mixture:
        loader = MixtureLoader({s.name: os.path.expanduser(s.path) for s in data.sources}, token_stages(data),
                               total_steps=None, shuffle=data.shuffle, gradient_accumulation=tr.gradient_accumulation,
                               repeat=data.repeat, **options)
    else:
        loader = ShardLoader(os.path.expanduser(data.train), shuffle=data.shuffle,
                             gradient_accumulation=tr.gradient_accumulation, **options)
    if loader.steps_per_epoch == 0:
        file = data.train_paths()[0][1]
        message = (f"{file if not mixture else 'the mixture'}: {loader.num_rows} sequences are fewer than one "
                   f"optimizer step needs ({loader.sequences_per_step} = batch_size x gradient_accumulation x "
                   "world_size)")
        raise AprError(message, [Finding("error", "apply.data", message, path="data.train", file=str(file))])
    steps = step_count(num_sequences=loader.num_rows, batch_size=data.batch_size,
                       gradient_accumulation=tr.gradient_accumulation, world_size=world, epochs=tr.epochs,
                       max_steps=tr.max_steps)
    if mixture:
        loader.set_total_steps(steps.total_steps)
    decay_start = decay_start_step(config, steps.total_steps)
    schedule = LRSchedule.from_config(config, steps.total_steps, decay_start=decay_start)
    return DataSide(loader, mixture, options, steps.epoch_steps, steps.total_steps,
                    steps.sequences_per_step * data.seq_len, schedule)
