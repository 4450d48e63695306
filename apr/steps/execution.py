"""The execution policy of the interleaved engine: what each step keeps and what it recomputes.

Torch-free. ``training.execution`` states it (``activations``, ``gradients``, ``compile``); ``auto``
is resolved by the plan (apr/plan/memory.py picks the fastest policy whose memory fits the budget)
and the engine runs exactly the resolved ``Execution``. The buffer plan
(apr/model/spec.py) allocates the gradient buffers it names; docs/design.md, "Execution policy".

Cost is counted in forward-equivalents F of the whole model (a backward is 2F):

* forward 1F, backward 2F;
* a recomputed block adds its forward again (1F over all blocks when every block is recomputed); a
  selectively recomputed block adds only its cheap ops (norms, activations, rope; SELECTIVE_F);
* a norm-only pre-pass walk (exact global clipping or the fp16 overflow check with one gradient
  workspace) adds another backward plus the recompute it needs (in full for selective blocks).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from importlib.util import find_spec

from apr.fmt import fmt_int, fmt_percent, fmt_seconds

# Share of a block's forward time that selective recompute repeats (norms, SwiGLU's silu and
# product, rope, residual adds). Measured on the CPU (benchmarks/bench_engine.py, docs/performance.md).
SELECTIVE_F = 0.25

ACTIVATION_KINDS = ("keep", "keep_first", "selective", "recompute")

# ``compile: auto`` (docs/design.md, "Compile when it pays"): the share of a step's time compiled
# blocks save, and the seconds compiling costs a run (its first steps), by device and by whether
# inductor's cache already holds the graphs (a resume, a second run). CPU: benchmarks/bench_compile.py
# (10.5M shape, fp32, one thread; CPU seconds: cold 33, warm 6; saving 2-9% across runs on the
# loaded 2-core box, docs/performance.md); CUDA: bench_engine.py on an H200 at 350M, bf16 (164 -> 95
# ms a step), its compile time not measured yet, so a generous guess. Probes or finished runs of
# both the eager and the compiled policy replace the saving by the measured one.
COMPILE_SAVES = {"cpu": 0.06, "cuda": 0.40}
COMPILE_COST_S = {"cpu": {"cold": 35.0, "warm": 8.0}, "cuda": {"cold": 120.0, "warm": 40.0}}
COMPILE_MARGIN = 2.0  # compile only when the time saved is this many times the compile time


@dataclass(frozen=True)
class Execution:
    """A resolved policy. ``kept_blocks``: the first blocks whose autograd graph the forward keeps
    (no recompute); ``rest``: how the other blocks are recomputed in the backward."""

    layers: int
    kept_blocks: int
    rest: str  # "selective" | "recompute"
    gradients: str  # "kept" | "workspace"
    compile: bool = False

    @property
    def activations(self) -> str:
        """The config spelling: keep, keep_first:K, selective or recompute."""
        if self.kept_blocks >= self.layers:
            return "keep"
        if self.kept_blocks == 0:
            return self.rest
        return f"keep_first:{self.kept_blocks}"

    def block_mode(self, i: int) -> str:
        """How block ``i`` is handled: keep, selective or recompute."""
        return "keep" if i < self.kept_blocks else self.rest

    @property
    def recomputed_blocks(self) -> int:
        return self.layers - self.kept_blocks

    def recompute_f(self) -> float:
        """Forward-equivalents one backward walk spends recomputing."""
        per_block = 1.0 if self.rest == "recompute" else SELECTIVE_F
        return per_block * self.recomputed_blocks / self.layers

    def cost_f(self, norm_prepass: bool) -> float:
        """Forward-equivalents of one micro-batch's step (forward, backward walk(s), recompute). A
        selectively kept graph can be backpropagated only once, so a norm-only pre-pass recomputes
        those blocks in full."""
        walk = 2.0 + self.recompute_f()
        prepass = 2.0 + self.recomputed_blocks / self.layers if norm_prepass else 0.0
        return 1.0 + walk + prepass

    def to_dict(self) -> dict:
        return {"activations": self.activations, "gradients": self.gradients, "compile": self.compile,
                "kept_blocks": self.kept_blocks, "recomputed_blocks": self.recomputed_blocks,
                "recompute": self.rest if self.recomputed_blocks else "none"}

    @classmethod
    def from_dict(cls, doc: dict, layers: int) -> Execution:
        """The inverse of ``to_dict`` (a plan file's choice)."""
        return parse(doc["activations"], doc["gradients"], layers, bool(doc.get("compile", False)))


def parse(activations: str, gradients: str, layers: int, compile: bool = False) -> Execution:
    """A stated (non-auto) policy; K of keep_first:K is capped at the number of blocks."""
    if activations == "keep":
        kept, rest = layers, "recompute"
    elif activations.startswith("keep_first:"):
        kept, rest = min(int(activations.split(":", 1)[1]), layers), "recompute"
    elif activations in ("selective", "recompute"):
        kept, rest = 0, activations
    else:
        raise ValueError(f"not a resolved activations policy: {activations!r}")
    if gradients not in ("kept", "workspace"):
        raise ValueError(f"not a resolved gradients policy: {gradients!r}")
    return Execution(layers, kept, rest, gradients, compile)


def gradients_forced(config) -> str | None:
    """``kept`` when the config leaves no choice (the standard engine, gradient accumulation, and
    ``training.reduction: canonical``, whose tree needs every micro-batch's whole gradient)."""
    tr = config.training
    if gradient_source(config) == "standard" or tr.gradient_accumulation > 1 or str(tr.reduction) == "canonical":
        return "kept"
    return None


def candidates(config) -> list[Execution]:
    """Every policy the config allows: the stated parts fixed, each ``auto`` part free."""
    ex = config.training.execution
    layers = config.model.architecture.num_hidden_layers
    forced = gradients_forced(config)
    grads = [str(ex.gradients)] if str(ex.gradients) != "auto" else ([forced] if forced else ["kept", "workspace"])
    if ex.activations != "auto":
        acts = [ex.activations]
    else:
        acts = ["keep", "selective", "recompute"] + [f"keep_first:{k}" for k in range(1, layers)]
    return [parse(a, g, layers, compile_stated(config)) for a in acts for g in grads]


def keeps_all_grads(config, execution: Execution) -> bool:
    """Every group's gradient lives for the whole step: forced (standard engine, accumulation) or
    chosen (``gradients: kept``)."""
    return gradients_forced(config) == "kept" or execution.gradients == "kept"


def needs_prepass(config, execution: Execution) -> bool:
    """A norm-only walk before the stepping walk: exact global clipping, fp16's overflow check or
    the bad-step gradient-norm test when gradients are not all kept (kept gradients know the norm
    after one walk)."""
    if gradient_source(config) == "standard" or keeps_all_grads(config, execution):
        return False
    return bool(prepass_reasons(config))


def prepass_reasons(config) -> list[str]:
    """What needs the global gradient norm before the first update (without kept gradients)."""
    tr = config.training
    clip = "off" if tr.grad_clip is None else str(tr.clip_mode)
    reasons = []
    if clip == "global":
        reasons.append("global norm")
    if str(tr.mixed_precision) == "fp16":
        reasons.append("fp16 overflow check")
    if tr.bad_steps.grad_norm_z is not None:
        reasons.append("bad-step test")
    return reasons


def step_cost_f(config, execution: Execution) -> float:
    """Forward-equivalents of one micro-batch's step. Autograd honours the policy too: its
    ``recompute``/``selective`` blocks run again under ``torch.utils.checkpoint`` in its one backward
    (no norm-only pre-pass: every gradient is kept until the step's end)."""
    if gradient_source(config) == "standard":
        return 3.0 + execution.recompute_f()
    return execution.cost_f(needs_prepass(config, execution))


def gradient_source(config) -> str:
    """What computes the gradients: ``interleaved`` (the flat-buffer walk) or ``standard`` (autograd).
    ``training.engine`` names it, except that distillation's losses read the teacher beside the
    student and run on autograd whatever it says (the plan prints that choice), and so does a
    stacking trunk stored in another precision or with adapters (the walk's flat groups hold each
    block's float32 weights; docs/design.md, "StackWise progressive stacks")."""
    from apr.steps.stacking import trunk_transformed  # lazy: it loads the schema (pydantic); this module does not

    tr = config.training
    autograd = str(tr.engine) == "standard" or str(tr.mode) == "distill" or trunk_transformed(config.model.stacking)
    return "standard" if autograd else "interleaved"


def fastest(config) -> Execution:
    """What ``auto`` means without a memory budget: the cheapest allowed policy (keep everything)."""
    return min(candidates(config), key=lambda e: (step_cost_f(config, e), e.gradients != "kept"))


def from_config(config) -> Execution:
    """The config's policy with every ``auto`` resolved as if memory were unlimited. The plan
    resolves ``auto`` against a budget instead and hands its choice to the engine."""
    ex = config.training.execution
    if ex.activations != "auto" and str(ex.gradients) != "auto":
        return parse(ex.activations, str(ex.gradients), config.model.architecture.num_hidden_layers,
                     compile_stated(config))
    return fastest(config)


def describe(config, execution: Execution) -> str:
    """One line: cost and what is kept, e.g. "3F: nothing recomputed, gradients kept"."""
    cost = step_cost_f(config, execution)
    n = execution.recomputed_blocks
    if gradient_source(config) == "standard":
        how = "selectively recomputed" if execution.rest == "selective" else "recomputed"
        again = "" if n == 0 else f", {n} of {execution.layers} blocks {how}"
        return f"{fmt_f(cost)}: standard engine (full autograd backward, every gradient kept{again})"
    if n == 0:
        what = "nothing recomputed"
    elif execution.rest == "selective":
        what = f"{n} of {execution.layers} blocks selectively recomputed (norms, activations, rope)"
    else:
        what = f"{n} of {execution.layers} blocks recomputed"
    grads = "gradients kept" if execution.gradients == "kept" else "one gradient workspace"
    prepass = "; a norm-only pre-pass walk" if needs_prepass(config, execution) else ""
    return f"{fmt_f(cost)}: {what}, {grads}{prepass}{'; blocks compiled' if execution.compile else ''}"


def fmt_f(cost: float) -> str:
    return f"{cost:.2f}".rstrip("0").rstrip(".") + "F"


def compile_problem(device_type: str) -> str | None:
    """Why ``compile: true`` cannot work on this machine for ``device_type``, when that is knowable
    without importing torch (inductor's C++ compiler is ``$CXX``, default g++; on CUDA it needs
    Triton); None when it looks able to."""
    if device_type == "cpu":
        cxx = os.environ.get("CXX") or "g++"
        if shutil.which(cxx) is None:
            return f"no C++ compiler for inductor on the CPU ({cxx} is not on PATH; set CXX)"
    elif device_type == "cuda":

        if find_spec("triton") is None:
            return "Triton is not installed (torch.compile's inductor needs it on CUDA)"
    return None


def compile_stated(config) -> bool:
    """``compile: true``. ``auto`` counts as false until the plan decides (``decide_compile``): tools
    and tests without a plan run eagerly."""
    return config.training.execution.compile is True


@dataclass(frozen=True)
class CompileDecision:
    """Whether the blocks are compiled, and why, as the plan prints it."""

    compile: bool
    setting: str  # what the config says: true, false or auto
    reason: str
    device: str | None = None
    steps: int | None = None
    step_seconds: float | None = None
    saving: float | None = None  # share of a step's time compiled blocks save
    saving_source: str | None = None
    saved_seconds: float | None = None
    compile_seconds: float | None = None
    cache: str | None = None  # warm or cold

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def decide_compile(config, *, device: str | None, total_steps: int | None, step_seconds: float | None,
                   step_basis: str = "", measured_saving: float | None = None, cache_warm: bool = False,
                   problem: str | None = None) -> CompileDecision:
    """Resolve ``training.execution.compile``. ``auto`` compiles when the time the run's steps save
    (steps x step time x the share compiled blocks save) is at least ``COMPILE_MARGIN`` times what
    compiling costs (cold or warm cache); it stays eager, saying why, when the device, the toolchain
    (``problem``), the run's length or its step time is unknown or cannot repay it."""
    setting = config.training.execution.compile
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"not a compile setting: {setting!r}")
    if setting is not True and setting != "auto":
        return CompileDecision(False, "false", "as stated in training.execution.compile")
    if setting is True:
        return CompileDecision(True, "true", "as stated in training.execution.compile", device=device)
    if config.model.architecture.moe is not None:  # compile: true is refused for it (apr/plan/moefacts.py)
        return CompileDecision(False, "auto", "a mixture of experts runs eager (its routing is not compiled)",
                               device=device)
    if device not in ("cpu", "cuda"):
        why = (f"torch.compile is not supported on {device} here" if device is not None
               else "the device is known only at apply (training.device auto without a GPU target)")
        return CompileDecision(False, "auto", why)
    if problem is not None:
        return CompileDecision(False, "auto", problem, device=device)
    if not total_steps:
        return CompileDecision(False, "auto", "the run's number of steps is unknown", device=device)
    if not step_seconds:
        how = ("`apr train plan --probe` measures it" if device == "cpu"
               else "name the GPU (--gpu) or probe it (--probe)")
        return CompileDecision(False, "auto", f"the step time is unknown ({how})", device=device,
                               steps=total_steps)
    saving, source = ((measured_saving, "measured by probes of both") if measured_saving is not None
                      else (COMPILE_SAVES[device], "assumed for the device"))
    cache = "warm" if cache_warm else "cold"
    cost = COMPILE_COST_S[device][cache]
    saved = total_steps * step_seconds * max(saving, 0.0)
    on = saving > 0 and saved >= COMPILE_MARGIN * cost
    basis = f" ({step_basis})" if step_basis else ""
    reason = (f"{fmt_int(total_steps)} steps x {fmt_seconds(step_seconds)}{basis} x {fmt_percent(saving)} saved = "
              f"{fmt_seconds(saved)} {'>=' if on else '<'} {COMPILE_MARGIN:g} x {fmt_seconds(cost)} compiling "
              f"({cache} cache)")
    return CompileDecision(on, "auto", reason, device=device, steps=total_steps, step_seconds=step_seconds,
                           saving=saving, saving_source=source, saved_seconds=saved, compile_seconds=cost, cache=cache)

