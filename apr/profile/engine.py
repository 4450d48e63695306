"""`apr profile CONFIG`: the engine a run of the config would build, and its training step timed.

The config is loaded as `apr train plan` loads it (``apr.config.loader.load_config``, the options
written in as command-line settings) and resolved by the plan's own function,
``apr.plan.build.resolve_config``, with the execution policy the plan chooses for this device
(``apr.plan.memory.choose_execution`` under the device's memory, as apply does when the plan names
no target). ``apr.train.build.build_engine`` builds the engine from that ``Resolved``: the
interleaved block walk or autograd, its execution policy, precision and kernels, exactly as a run
would. What is timed is that engine's own ``train_step`` on synthetic micro-batches of the planned
shape (``data.batch_size`` x ``data.seq_len``, ``training.gradient_accumulation`` of them a step).

One process, no data read: the step counts and the LR schedule (which need the data's rows) are
not resolved, the step runs at ``optimizer.lr``, and a config planned for several ranks is
profiled as one of its ranks without the all-reduce or FSDP2 (the report says so).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from apr.config.loader import load_config
from apr.errors import AprError, Finding
from apr.memory.table import memory_table
from apr.plan.build import resolve_config
from apr.plan.memory import choose_execution
from apr.profile.clock import Clock
from apr.profile.step import count_flops, kernel_time
from apr.steps.execution import describe
from apr.steps.resolved import Resolved
from apr.train.build import build_engine
from apr.train.devicemem import device_budget
from apr.train.engine import resolve_device

SOURCES = {"interleaved": "the interleaved block walk", "standard": "autograd"}


@dataclass
class EngineInfo:
    """What was profiled: the engine the run would build and the plan it was built from."""

    config: str  # the config file
    engine: str  # the engine's kind: interleaved, standard, or its loss's (distill)
    gradient_source: str  # interleaved (the block walk) or standard (autograd)
    source_text: str  # the gradient source in words
    execution: dict  # the resolved policy (apr.steps.execution.Execution.to_dict)
    execution_text: str  # apr.steps.execution.describe: cost in forward-equivalents and what is kept
    execution_basis: str  # stated in the config, or chosen by the plan under which memory
    strategy: str  # the step strategy: clip mode, kept gradients, pre-pass, loss scaling
    world_size: int  # the ranks the plan laid the config out for
    sharding: str  # training.sharding as planned
    profiled_as: str  # what one process of `apr profile` runs of that layout
    kernels: str  # the kernel backend in force

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineStepProfile:
    """The engine's ``train_step`` on synthetic micro-batches: medians over the timed steps."""

    device: str
    precision: str
    batch_size: int  # one micro-batch's sequences
    seq_len: int
    gradient_accumulation: int  # micro-batches per step
    steps: int  # timed steps (after one warm-up step)
    step_s: float  # median timed step
    counted_flops: int  # one step as torch's flop counter sees it (recompute and pre-pass walks included)
    counted_by_op: dict[str, int]
    peak_bytes: int | None  # GPU only: torch.cuda.max_memory_allocated over a timed step
    weight_bytes: int
    buffer_bytes: int  # the engine's own buffers (flat parameters, moments, gradients; 0 for autograd)
    kernels: dict | None = None  # GPU only: kernel time, utilisation, top kernels (torch.profiler)
    samples_s: list[float] = field(default_factory=list)  # every timed step, in order

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len * self.gradient_accumulation

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["tokens"] = self.tokens
        doc["counted_flops_per_token"] = self.counted_flops / self.tokens
        doc["tokens_per_s"] = self.tokens / self.step_s if self.step_s > 0 else None
        return doc


def is_config(source: Path) -> bool:
    """A YAML file: a config to resolve and build, not weights to load."""
    return source.suffix.lower() in (".yaml", ".yml")


def _settings(options) -> dict:
    """The options that change what is planned, as command-line settings of the config."""
    out = {"training.device": options.device, "training.mixed_precision": options.precision,
           "data.batch_size": options.batch_size, "data.seq_len": options.seq_len}
    return {k: v for k, v in out.items() if v is not None}


def resolve_for_profile(path: Path, options) -> tuple[Resolved, str]:
    """The config resolved as the plan resolves it, with the policy the plan would choose on this
    device: ``(resolved, basis)``, basis saying where the policy came from."""
    config = load_config(path, _settings(options)).config
    laid = resolve_config(config, data=False)
    budget = device_budget(laid.config)
    choice = choose_execution(laid.config, *(budget or (None, None)))
    if not choice.auto:
        basis = "stated in training.execution"
    elif budget is None:
        basis = "auto, chosen with no memory budget (this device's memory is unknown)"
    else:
        basis = f"auto, chosen by the plan to fit {budget[1]}"
    return resolve_config(config, data=False, execution=choice.execution), basis


def one_process_rows(resolved: Resolved, batch_size: int | None = None) -> list:
    """The plan's memory rows for what one `apr profile` process builds: the resolved config on one
    unsharded rank (at micro-batch ``batch_size``, default the planned one), under the resolved policy."""
    config = resolved.config
    data = config.data.model_copy(update={"batch_size": batch_size or config.data.batch_size})
    training = config.training.model_copy(update={"world_size": 1, "sharding": "none"})
    one = config.model_copy(update={"data": data, "training": training})
    return memory_table(one, execution=resolved.execution)


def one_process_bytes(resolved: Resolved, batch_size: int | None = None) -> int:
    return sum(r.bytes for r in one_process_rows(resolved, batch_size))


def _profiled_as(resolved: Resolved) -> str:
    if resolved.world_size == 1 and not resolved.sharded:
        return "the whole run: one process"
    shard = f", sharding {resolved.sharding}" if resolved.sharded else ""
    return (f"one rank of {resolved.world_size}{shard}, on one process: its micro-batches without the "
            "gradient all-reduce or FSDP2")


def engine_info(path: Path, resolved: Resolved, engine, basis: str) -> EngineInfo:
    return EngineInfo(
        config=str(path), engine=engine.kind, gradient_source=engine.source,
        source_text=SOURCES.get(engine.source, engine.source),
        execution=resolved.execution.to_dict(), execution_text=describe(resolved.config, resolved.execution),
        execution_basis=basis, strategy=resolved.strategy.describe(), world_size=resolved.world_size,
        sharding=resolved.sharding, profiled_as=_profiled_as(resolved), kernels=engine.backend.name)


def build(resolved: Resolved):
    """``build_engine`` of the resolved plan on the device it names; a config the engine cannot
    build is refused with the reason."""
    tr = resolved.config.training
    device = resolve_device(str(tr.device))
    try:
        return build_engine(resolved, device)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise AprError(f"building the engine ran out of memory on {device}: {err}".strip(), [Finding(
            "error", "profile.oom", "the engine does not fit the device", path="--batch-size",
            expected="an engine that fits the device", got=type(err).__name__)]) from None


class _Step:
    """One ``train_step`` of the engine on fixed synthetic micro-batches."""

    def __init__(self, engine, seed: int = 0):
        config = engine.config
        b, s = config.data.batch_size, config.data.seq_len
        gen = torch.Generator(device="cpu").manual_seed(seed)
        vocab = config.model.architecture.vocab_size
        self.engine = engine
        self.micro = [torch.randint(0, vocab, (b, s + 1), generator=gen).to(engine.device)
                      for _ in range(config.training.gradient_accumulation)]
        self.lr = float(config.optimizer.lr)

    def __call__(self) -> None:
        self.engine.train_step(self.micro, self.lr)


def profile_engine(engine, *, steps: int = 3) -> EngineStepProfile:
    """One warm-up step, ``steps`` timed steps of ``engine.train_step``, then one step under
    torch's flop counter and, on a GPU, one under torch.profiler for the kernel time."""
    engine.model.train()
    step = _Step(engine)
    clock = Clock(engine.device)
    step()  # warm-up: allocator, optimizer state, kernels chosen
    times, peak = [], None
    for _ in range(steps):
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        clock.sync()
        t0 = time.perf_counter()
        step()
        clock.sync()
        times.append(time.perf_counter() - t0)
        if clock.cuda:
            peak = max(peak or 0, torch.cuda.max_memory_allocated())
    flops, by_op = count_flops(step)
    median = statistics.median(times)
    config = engine.config
    return EngineStepProfile(
        device=str(engine.device), precision=str(config.training.mixed_precision),
        batch_size=config.data.batch_size, seq_len=config.data.seq_len,
        gradient_accumulation=config.training.gradient_accumulation, steps=steps, step_s=median,
        counted_flops=flops, counted_by_op=by_op, peak_bytes=peak,
        weight_bytes=sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        buffer_bytes=sum(engine.buffer_bytes().values()),
        kernels=kernel_time(step, median) if clock.cuda else None, samples_s=times)
