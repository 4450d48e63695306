"""`apr profile SOURCE`: load a checkpoint, run directory or Hugging Face folder, measure one
training step and the inference latency, and compare the step with the plan's figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from apr.errors import AprError, Finding
from apr.generate.load import load_for_inference
from apr.profile.compare import Comparison, compare, plan_config
from apr.profile.latency import LatencyRow, check_lengths, measure_latency
from apr.profile.step import StepProfile, profile_step

FORMAT_VERSION = "1"


class ProfileOptionError(AprError):
    """An option of `apr profile` out of its range."""


@dataclass(frozen=True)
class ProfileOptions:
    device: str = "cpu"
    precision: str | None = None  # None: the run's mixed_precision on a GPU, fp32 on the CPU
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
    step: StepProfile | None = None
    latency: list[LatencyRow] = field(default_factory=list)
    comparison: list[Comparison] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "source": self.source, "kind": self.kind,
                "checkpoint_step": self.step_number, "parameters": self.parameters,
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


def _precision(loaded, options: ProfileOptions) -> str:
    if options.precision is not None:
        return options.precision
    if loaded.device.type == "cpu" or loaded.config is None:
        return "fp32" if loaded.device.type == "cpu" else "bf16"
    return str(loaded.config.training.mixed_precision)


def _prompt_base(loaded, options: ProfileOptions) -> list[int]:
    if options.prompt is None:
        return []
    ids = loaded.tokenizer.encode(options.prompt, add_special_tokens=False).ids
    if not ids:
        raise ProfileOptionError("--prompt encodes to no tokens", [Finding(
            "error", "profile.empty_prompt", "the prompt has no tokens", path="--prompt",
            expected="at least one token", got="0")])
    return ids


def profile_source(source: str | Path, options: ProfileOptions) -> ProfileReport:
    """Everything `apr profile` measures: the training step (it trains the loaded model at lr 1e-12:
    the weights barely move), then latency. In that order because decoding runs under
    ``torch.inference_mode`` and the model caches its RoPE tables by length: a table made there
    could not be saved for a later backward of the same length."""
    options.check()
    loaded = load_for_inference(source, tokenizer=options.tokenizer, device=options.device,
                                need_tokenizer=options.prompt is not None)
    model = loaded.model
    report = ProfileReport(source=str(loaded.source), kind=loaded.kind, step_number=loaded.step,
                           parameters=sum(p.numel() for p in model.parameters()))
    if options.latency:  # bad input is refused before anything is measured
        base = _prompt_base(loaded, options)
        lengths = list(options.lengths) or [len(base) if base else min(128, loaded.context - options.new_tokens)]
        check_lengths(lengths, options.new_tokens, loaded.context)
    if options.step:
        batch, seq = _step_shape(loaded, options)
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
