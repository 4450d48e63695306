"""The run's data side, set up from the resolved plan: the training loader (one source or a mixture)
at the plan's step counts; and each step's micro-batches (``micro_batches``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from apr.data.loader import ShardLoader
from apr.data.mixconfig import token_stages
from apr.data.mixloader import MixtureLoader
from apr.errors import AprError, Finding


@dataclass
class DataSide:
    loader: ShardLoader | MixtureLoader
    mixture: bool
    loader_options: dict  # what a validation loader needs to read rows alike


def micro_batches(loader, count: int, pin: bool) -> list:
    """The next optimizer step's ``count`` micro-batches. ``pin`` (a CUDA run): in page-locked host
    memory, so the engine's ``batch.to(device, non_blocking=True)`` is a copy queued on the stream; from
    pageable memory CUDA synchronizes the stream before the copy, a host wait for the previous step
    at every step."""
    batches = [loader.next_batch() for _ in range(count)]
    return [b.pin_memory() for b in batches] if pin else batches


def data_side(plan, dp, warn) -> DataSide:
    """The training loader for the resolved plan (``plan``: apr.steps.resolved.Resolved), at the
    plan's step counts: rows that differ from the ones the plan counted are refused (the data changed
    after the plan was made)."""
    config = plan.config
    tr, data = config.training, config.data
    rank, world = (0, 1) if dp is None else (dp.rank, dp.world_size)
    options = dict(seq_len=data.seq_len, batch_size=data.batch_size, seed=tr.seed, world_size=world, rank=rank,
                   input_column=data.input_column, vocab_size=config.model.architecture.vocab_size, on_warning=warn)
    if tr.custom is not None:  # training.mode custom: every batch carries its targets (training and validation)
        options["targets_column"] = tr.custom.targets_column
    mixture = data.sources is not None
    if mixture:
        loader = MixtureLoader({s.name: os.path.expanduser(s.path) for s in data.sources}, token_stages(data),
                               total_steps=None, shuffle=data.shuffle, gradient_accumulation=tr.gradient_accumulation,
                               repeat=data.repeat, **options)
    else:
        loader = ShardLoader(os.path.expanduser(data.train), shuffle=data.shuffle,
                             gradient_accumulation=tr.gradient_accumulation, **options)
    file = data.train_paths()[0][1] if not mixture else "the mixture"
    if loader.num_rows != plan.steps.num_sequences:
        message = (f"{file}: {loader.num_rows} training sequences, but the plan counted "
                   f"{plan.steps.num_sequences}: the data changed after the plan was made; plan again")
        raise AprError(message, [Finding("error", "apply.data", message, path="data.train", file=str(file),
                                         expected=str(plan.steps.num_sequences), got=str(loader.num_rows))])
    if loader.steps_per_epoch == 0:
        message = (f"{file}: {loader.num_rows} sequences are fewer than one "
                   f"optimizer step needs ({loader.sequences_per_step} = batch_size x gradient_accumulation x "
                   "world_size)")
        raise AprError(message, [Finding("error", "apply.data", message, path="data.train", file=str(file))])
    if mixture:
        loader.set_total_steps(plan.steps.total_steps)
    return DataSide(loader, mixture, options)
