"""`apr profile SOURCE`: load a checkpoint, run directory or Hugging Face folder, measure one
training step and the inference latency, and compare the step with the plan's figures; or, for a
config, build the engine its run would build and time that engine's step (apr/profile/engine.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from apr.data.tokenizer import load_tokenizer
from apr.errors import AprError, Finding
from apr.generate.load import load_for_inference
from apr.memory.table import memory_table
from apr.profile import engine as engine_profile
from apr.profile.compare import Comparison, compare, compare_engine, plan_config
from apr.profile.engine import EngineInfo, EngineStepProfile
from apr.profile.latency import LatencyRow, check_lengths, measure_latency
from apr.profile.step import StepProfile, profile_step
from apr.readers import human_bytes

FORMAT_VERSION = "1"


class ProfileOptionError(AprError):
    """An option of `apr profile` out of its range."""


# Upper bounds: medians settle within a few runs; more only holds the machine (each step and each
# repeat is a whole forward and backward, or a whole prefill and decode).
MAX_STEPS = 1000
MAX_REPEATS = 1000


@dataclass(frozen=True)
class ProfileOptions:
    device: str | None = None  # None: a config's training.device, else the CPU
    # None: a config's training.mixed_precision; for weights the run's on a GPU, fp32 on the CPU
    precision: str | None = None
    batch_size: int | None = None  # None: the run's data.batch_size (1 for a Hugging Face folder)
    seq_len: int | None = None  # None: the run's data.seq_len, at most the context
    steps: int = 3
    prompt: str | None = None
    lengths: tuple[int, ...] = ()  # () : the prompt's own length, or 128 positions at most
    new_tokens: int = 32
    repeats: int = 5
    step: bool = True
    latency: bool = True
    compare: bool = False
    tokenizer: Path | None = None

    def check(self) -> None:
        for option, value, low in (("--steps", self.steps, 1), ("--repeats", self.repeats, 1),
                                   ("--new-tokens", self.new_tokens, 1), ("--batch-size", self.batch_size, 1),
                                   ("--seq-len", self.seq_len, 1)):
            if value is not None and value < low:
                raise ProfileOptionError(f"{option} must be at least {low}, not {value}", [Finding(
                    "error", "profile.option", f"{option} out of range", path=option, expected=f">= {low}",
                    got=str(value))])
        for option, value, high in (("--steps", self.steps, MAX_STEPS), ("--repeats", self.repeats, MAX_REPEATS)):
            if value > high:
                raise ProfileOptionError(f"{option} must be at most {high:,}, not {value:,}", [Finding(
                    "error", "profile.option", f"{option} out of range", path=option, expected=f"<= {high:,}",
                    got=f"{value:,}")])
        if self.precision not in (None, "fp32", "bf16", "fp16"):
            raise ProfileOptionError(f"--precision must be fp32, bf16 or fp16, not {self.precision}", [Finding(
                "error", "profile.option", "unknown precision", path="--precision", expected="fp32, bf16 or fp16",
                got=str(self.precision))])
        if not self.step and not self.latency:
            raise ProfileOptionError("--no-step and --no-latency leave nothing to measure", [Finding(
                "error", "profile.option", "nothing to measure", path="--no-step/--no-latency")])


@dataclass
class ProfileReport:
    source: str
    kind: str
    step_number: int | None
    parameters: int
    step: StepProfile | EngineStepProfile | None = None
    latency: list[LatencyRow] = field(default_factory=list)
    comparison: list[Comparison] = field(default_factory=list)
    engine: EngineInfo | None = None  # a config: the engine its run would build

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "source": self.source, "kind": self.kind,
                "checkpoint_step": self.step_number, "parameters": self.parameters,
                "engine": self.engine.to_dict() if self.engine else None,
                "step": self.step.to_dict() if self.step else None,
                "latency": [r.to_dict() for r in self.latency],
                "compare": [c.to_dict() for c in self.comparison]}


def _step_shape(loaded, options: ProfileOptions) -> tuple[int, int]:
    context = loaded.context
    data = loaded.config.data if loaded.config is not None else None
    batch = options.batch_size or (data.batch_size if data else 1)
    seq = options.seq_len or min(data.seq_len if data else 512, context)
    if seq > context:
        raise ProfileOptionError(f"--seq-len {seq} is longer than the model's context of {context} positions", [
            Finding("error", "profile.seq_too_long", "sequence longer than the context", path="--seq-len",
                    expected=f"<= {context}", got=str(seq))])
    return batch, seq


def _memory_budget(device) -> tuple[int, str] | None:
    """What the profiled step must fit in: the CUDA device's memory, or the RAM available now."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"the memory of {props.name}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "the RAM available now"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    except (ValueError, OSError, AttributeError):
        return None


def step_bytes(loaded, batch: int, seq: int, precision: str) -> int:
    """The plan's peak for the profiled step (engine standard, this batch, length, precision and
    device): ``apr.memory.table.memory_table``, as `--compare` shows it."""
    shape = SimpleNamespace(device=str(loaded.device), batch_size=batch, seq_len=seq, precision=precision)
    return sum(r.bytes for r in memory_table(plan_config(loaded.config, loaded.arch, shape)))


def check_step_fits(loaded, options: ProfileOptions, batch: int, seq: int, precision: str) -> None:
    """Refuse a step the plan says cannot fit this device's memory, before allocating any of it (a
    --batch-size of 100,000 otherwise grows until the machine kills the process)."""
    _refuse_unless_fits(lambda b: step_bytes(loaded, b, seq, precision), loaded.device, options, batch, seq)


def _refuse_unless_fits(need_of, device, options: ProfileOptions, batch: int, seq: int) -> None:
    """``need_of(batch)``: the plan's bytes for a step of that micro-batch."""
    budget = _memory_budget(device)
    if budget is None:
        return
    limit, where = budget
    need = need_of(batch)
    if need <= limit:
        return
    fit = batch
    while fit > 1 and need_of(fit) > limit:
        fit //= 2
    option = "--batch-size" if options.batch_size is not None or options.seq_len is None else "--seq-len"
    message = (f"a training step of batch {batch:,} x {seq:,} tokens needs about {human_bytes(need)} by the "
               f"plan's memory estimate, more than {where} ({human_bytes(limit)}); use a smaller {option}"
               + (f" (batch {fit:,} fits)" if option == "--batch-size" and fit < batch and need_of(fit) <= limit
                  else ""))
    raise ProfileOptionError(message, [Finding(
        "error", "profile.too_large", "the step does not fit memory", path=option,
        expected=f"at most {human_bytes(limit)} ({where})", got=f"about {human_bytes(need)}")])


def _precision(loaded, options: ProfileOptions) -> str:
    if options.precision is not None:
        return options.precision
    if loaded.device.type == "cpu" or loaded.config is None:
        return "fp32" if loaded.device.type == "cpu" else "bf16"
    return str(loaded.config.training.mixed_precision)


def _prompt_base(tokenizer, options: ProfileOptions) -> list[int]:
    if options.prompt is None:
        return []
    ids = tokenizer.encode(options.prompt, add_special_tokens=False).ids
    if not ids:
        raise ProfileOptionError("--prompt encodes to no tokens", [Finding(
            "error", "profile.empty_prompt", "the prompt has no tokens", path="--prompt",
            expected="at least one token", got="0")])
    return ids


def _latency_lengths(base: list[int], options: ProfileOptions, context: int) -> list[int]:
    """The prompt lengths to time, refused before anything is measured when one does not fit."""
    lengths = list(options.lengths) or [len(base) if base else min(128, context - options.new_tokens)]
    check_lengths(lengths, options.new_tokens, context)
    return lengths


def profile_source(source: str | Path, options: ProfileOptions) -> ProfileReport:
    """Everything `apr profile` measures: the training step (it trains the loaded model at lr 1e-12:
    the weights barely move), then latency. In that order because decoding runs under
    ``torch.inference_mode`` and the model caches its RoPE tables by length: a table made there
    could not be saved for a later backward of the same length. A config (``.yaml``): the engine its
    run would build instead (``profile_config``)."""
    options.check()
    if engine_profile.is_config(Path(source)):
        return profile_config(Path(source), options)
    loaded = load_for_inference(source, tokenizer=options.tokenizer, device=options.device or "cpu",
                                need_tokenizer=options.prompt is not None)
    model = loaded.model
    report = ProfileReport(source=str(loaded.source), kind=loaded.kind, step_number=loaded.step,
                           parameters=sum(p.numel() for p in model.parameters()))
    if options.latency:  # bad input is refused before anything is measured
        base = _prompt_base(loaded.tokenizer, options)
        lengths = _latency_lengths(base, options, loaded.context)
    if options.step:
        batch, seq = _step_shape(loaded, options)
        check_step_fits(loaded, options, batch, seq, _precision(loaded, options))
        for p in model.parameters():
            p.requires_grad_(True)
        report.step = profile_step(model, batch_size=batch, seq_len=seq, precision=_precision(loaded, options),
                                   steps=options.steps)
        if options.compare:
            report.comparison = compare(report.step, plan_config(loaded.config, loaded.arch, report.step))
    if options.latency:
        report.latency = measure_latency(model, base, lengths, new_tokens=options.new_tokens,
                                         repeats=options.repeats)
    return report


def _config_tokenizer(config, options: ProfileOptions):
    """The tokenizer for --prompt with a config: --tokenizer, else the config's data.tokenizer."""
    if options.prompt is None:
        return None
    path = options.tokenizer or config.data.tokenizer
    if path is None:
        raise ProfileOptionError("--prompt with a config needs a tokenizer: pass --tokenizer FILE (the config "
                                 "names no data.tokenizer)", [Finding(
                                     "error", "profile.option", "no tokenizer for --prompt", path="--tokenizer",
                                     expected="a tokenizer.json", got="none")])
    return load_tokenizer(path)


def _check_config_shape(config) -> None:
    seq, context = config.data.seq_len, config.model.architecture.max_position_embeddings
    if seq > context:
        raise ProfileOptionError(f"data.seq_len {seq} is longer than the model's context of {context} positions", [
            Finding("error", "profile.seq_too_long", "sequence longer than the context", path="--seq-len",
                    expected=f"<= {context}", got=str(seq))])


def profile_config(path: Path, options: ProfileOptions) -> ProfileReport:
    """A config: resolved as `apr train plan` resolves it, the engine its run would build
    (``build_engine``), that engine's ``train_step`` timed on synthetic micro-batches of the planned
    shape, then latency on the engine's model (weights as initialised). Bad input is refused before
    the engine is built."""
    resolved, basis = engine_profile.resolve_for_profile(path, options)
    config = resolved.config
    context = config.model.architecture.max_position_embeddings
    if options.latency:
        base = _prompt_base(_config_tokenizer(config, options), options)
        lengths = _latency_lengths(base, options, context)
    if options.step:
        _check_config_shape(config)
        _refuse_unless_fits(lambda b: engine_profile.one_process_bytes(resolved, b),
                            engine_profile.resolve_device(str(config.training.device)), options,
                            config.data.batch_size, config.data.seq_len)
    engine = engine_profile.build(resolved)
    report = ProfileReport(source=str(path), kind="config", step_number=None,
                           parameters=sum(p.numel() for p in engine.model.parameters()),
                           engine=engine_profile.engine_info(path, resolved, engine, basis))
    if options.step:
        report.step = engine_profile.profile_engine(engine, steps=options.steps)
        if options.compare:
            report.comparison = compare_engine(report.step, resolved)
    if options.latency:
        with engine.whole_weights():
            report.latency = measure_latency(engine.model, base, lengths, new_tokens=options.new_tokens,
                                             repeats=options.repeats)
    return report
