"""What the plan decided for one run, frozen and handed to the trainer (decision 13 of the design;
docs/design.md, "The composed engine" and "Steps, strategy and schedules (`apr/steps/`)").

``resolve`` is the one function that turns a config into what runs: the config laid out at the
world size (and a resume's gradient accumulation), the execution policy, the gradient source, the
sharding in force, the step strategy, the step counts over the data's rows and the LR schedule.
``apr train plan`` calls it with the data's row count from the Parquet footers and its own
execution choice (``Plan.resolved``); a caller without a plan (tests, lr-find, sweeps' trials,
probe, profile, benchmarks) calls the plan's ``apr.plan.build.resolve_config``, which reads the same
footers and calls it too. The trainer (``apr/train``) receives the ``Resolved`` and derives none of
these again, and never edits the config. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from apr.config.schema import AprConfig
from apr.steps import execution as execution_policy
from apr.steps.algebra import step_count
from apr.steps.execution import Execution
from apr.steps.schedule import LRSchedule
from apr.steps.strategy import StepStrategy, step_strategy


@dataclass(frozen=True)
class RunSteps:
    """The step algebra of the run over its data (apr/steps/algebra.py)."""

    num_sequences: int  # training rows the plan counted (each seq_len + 1 tokens)
    sequences_per_step: int  # batch_size x gradient_accumulation x world_size
    steps_per_epoch: int
    epoch_steps: int  # epochs x steps_per_epoch: what the data can supply
    total_steps: int  # min(max_steps, epoch_steps)
    tokens_per_step: int  # sequences_per_step x seq_len (predicted positions)
    decay_start: int | None  # the step a wsd decay starts at (training.decay_stage), else None


@dataclass(frozen=True)
class Resolved:
    config: AprConfig  # layered, overridden and laid out (world size, gradient accumulation)
    execution: Execution  # the plan's policy at the config's depth
    world_size: int
    nodes: int
    gradient_source: str  # "interleaved" (the flat-buffer walk) or "standard" (autograd)
    sharding: str  # training.sharding: FSDP2 over the process group torchrun starts (none without one)
    strategy: StepStrategy  # clip mode, kept gradients, norm pre-pass, loss scaling
    steps: RunSteps | None  # None: an engine-only resolution (no data read); a run needs them
    schedule: LRSchedule | None  # with the steps
    elastic: Mapping | None = None  # a resume on another world size: from/to ranks and accumulation, message

    @property
    def total_steps(self) -> int | None:
        return None if self.steps is None else self.steps.total_steps

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"

    @property
    def reduction(self) -> str:
        """``training.reduction``: ``fast`` (micro-batches accumulated, ranks all-reduced) or
        ``canonical`` (one fixed tree over the global micro-batches: apr/train/reduction.py)."""
        return str(self.config.training.reduction)

    def execution_at(self, layers: int) -> Execution:
        """The same policy at another depth (progressive stacking's earlier stages)."""
        if layers == self.execution.layers:
            return self.execution
        return Execution.from_dict(self.execution.to_dict(), layers)

    def at_depth(self, config: AprConfig) -> Resolved:
        """This plan for one stage of a progressive stack (``config``: ``apr.steps.stacking.config_at``
        of the planned config): the stage's depth, everything else as planned."""
        if config is self.config:
            return self
        execution = self.execution_at(config.model.architecture.num_hidden_layers)
        return replace(self, config=config, execution=execution, strategy=step_strategy(config, execution))

    def with_clip(self, config: AprConfig) -> Resolved:
        """An orchestrator branch that changes ``training.grad_clip``/``clip_mode`` (a planned
        candidate, apr/steps/orchestration.py): the same plan, the branch's step strategy."""
        return replace(self, config=config, strategy=step_strategy(config, self.execution))


class ResolveError(ValueError):
    """The config cannot be resolved as it stands (the plan reports it as a finding)."""


def laid_out(config: AprConfig, world_size: int, accumulation: int | None = None) -> AprConfig:
    """The config at ``world_size`` ranks (and ``accumulation``), as a new validated config; the
    same object when nothing changes."""
    tr = config.training
    if tr.world_size == world_size and (accumulation is None or tr.gradient_accumulation == accumulation):
        return config
    doc = config.model_dump(mode="json")
    doc["training"]["world_size"] = world_size
    if accumulation is not None:
        doc["training"]["gradient_accumulation"] = accumulation
    return AprConfig.model_validate(doc)


def run_steps(config: AprConfig, num_sequences: int, world_size: int, decay_start_of=None) -> RunSteps:
    """The step counts of ``config`` over ``num_sequences`` training rows on ``world_size`` ranks;
    ``decay_start_of(config, total_steps)``: the step ``training.decay_stage`` starts at (the plan's
    ``apr.data.mixconfig.decay_start_step``, which reads the mixture's stages)."""
    tr, data = config.training, config.data
    if getattr(tr, "decay_stage", None) and decay_start_of is None:
        raise ResolveError("training.decay_stage: its start is a data stage's; resolve through the plan "
                           "(apr.plan.build.resolve_config)")
    count = step_count(num_sequences=num_sequences, batch_size=data.batch_size,
                       gradient_accumulation=tr.gradient_accumulation, world_size=world_size, epochs=tr.epochs,
                       max_steps=tr.max_steps)
    return RunSteps(num_sequences, count.sequences_per_step, count.steps_per_epoch, count.epoch_steps,
                    count.total_steps, count.sequences_per_step * data.seq_len,
                    decay_start_of(config, count.total_steps) if decay_start_of is not None else None)


def resolve(config: AprConfig, *, world_size: int | None = None, nodes: int = 1, num_sequences: int | None = None,
            execution: Execution | None = None, elastic: Mapping | None = None, decay_start_of=None) -> Resolved:
    """What runs for ``config``: laid out at ``world_size`` (default: ``training.world_size``) and,
    with ``elastic`` (a resume on another number of ranks), at its gradient accumulation. Without
    ``execution`` the config's own policy (``auto`` as if memory were unlimited); without
    ``num_sequences`` no step counts (an engine-only resolution)."""
    world = int(world_size or config.training.world_size)
    config = laid_out(config, world, int(elastic["to_accumulation"]) if elastic else None)
    layers = config.model.architecture.num_hidden_layers
    if execution is None:
        execution = execution_policy.from_config(config)
    elif execution.layers != layers:
        execution = Execution.from_dict(execution.to_dict(), layers)
    steps = schedule = None
    if num_sequences is not None:
        steps = run_steps(config, num_sequences, world, decay_start_of)
        schedule = LRSchedule.from_config(config, steps.total_steps, decay_start=steps.decay_start)
    sharding = str(config.training.sharding)  # under a process group (torchrun), even of one rank
    return Resolved(config=config, execution=execution, world_size=world, nodes=int(nodes),
                    gradient_source=execution_policy.gradient_source(config), sharding=sharding,
                    strategy=step_strategy(config, execution), steps=steps, schedule=schedule,
                    elastic=dict(elastic) if elastic else None)
