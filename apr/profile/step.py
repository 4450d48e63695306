"""One training step (forward, loss, backward, AdamW) measured layer by layer.

The step is the model's own: ``LlamaForCausalLM.hidden_states`` then ``LlamaForCausalLM.loss`` (the
loss entry point every engine calls), under plain autograd, with the run's precision as autocast.
Per layer it records forward and backward time (module hooks putting marks on a ``Clock``), the
bytes autograd saves for the backward (a ``saved_tensors_hooks`` pack hook; weights excluded) and,
on a GPU, the peak memory while the layer's backward runs. The hooks are the only thing the
profiled step adds, and the unprofiled steps of the same run measure what they cost.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, addmm_flop, sdpa_backward_flop_count, sdpa_flop_count

from apr.profile.clock import Clock

HEAD = "head+loss"  # the final norm, the LM head and cross-entropy (model.loss)
EMBED = "embed_tokens"
OPTIMIZER = "optimizer"  # the mark after AdamW's step


@dataclass
class LayerRow:
    name: str  # embed_tokens, layers.N, head+loss, optimizer
    forward_s: float
    backward_s: float
    saved_bytes: int  # activations autograd keeps from this layer's forward for its backward
    backward_peak_bytes: int | None = None  # GPU only: peak allocated while its backward ran

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepProfile:
    device: str
    precision: str
    batch_size: int
    seq_len: int
    layers: list[LayerRow]
    step_s: float  # median profiled step
    unprofiled_step_s: float  # median step without hooks, same run, interleaved with the profiled ones
    steps: int  # profiled (and as many unprofiled) steps the medians are over
    optimizer_s: float  # AdamW over every parameter (median of the profiled steps)
    counted_flops: int  # FLOPs of one step (forward + backward) as torch's flop counter sees them
    counted_by_op: dict[str, int]
    peak_bytes: int | None  # GPU only: torch.cuda.max_memory_allocated over the step
    weight_bytes: int
    kernels: dict | None = None  # GPU only: kernel time, utilisation, top kernels (torch.profiler)
    profiled_samples_s: list[float] = field(default_factory=list)  # every profiled step, in order
    unprofiled_samples_s: list[float] = field(default_factory=list)  # every unprofiled step, in order

    @property
    def overhead_fraction(self) -> float:
        return self.step_s / self.unprofiled_step_s - 1.0 if self.unprofiled_step_s > 0 else 0.0

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["overhead_fraction"] = round(self.overhead_fraction, 4)
        doc["tokens"] = self.tokens
        doc["counted_flops_per_token"] = self.counted_flops / self.tokens
        doc["tokens_per_s"] = self.tokens / self.unprofiled_step_s if self.unprofiled_step_s > 0 else None
        return doc


class _Recorder:
    """The hooks: forward/backward marks per module and saved-tensor bytes per current layer."""

    def __init__(self, model, clock: Clock):
        self.clock = clock
        self.marks: dict[tuple[str, str], object] = {}
        self.saved: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.current = EMBED
        self._seen: set[int] = set()
        self._weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._handles = []
        modules = [(EMBED, model.model.embed_tokens)] + [(f"layers.{i}", m) for i, m in enumerate(model.model.layers)]
        for name, module in modules:
            self._handles += [module.register_forward_pre_hook(self._enter(name)),
                              module.register_forward_hook(self._exit(name))]

    # The backward is timed by gradient hooks on the layer's output (its gradient arrives: the
    # layer's backward starts) and on its input (its gradient is computed: the layer's backward
    # ends), registered during the forward. Tensor hooks cost a fraction of full module backward
    # hooks, which wrap every input and output in an extra autograd node.

    def _mark(self, name: str, what: str) -> None:
        self.marks[(name, what)] = self.clock.mark()

    def _enter(self, name: str):
        def hook(_module, args):
            self.current = name
            self._mark(name, "fwd0")
            x = args[0]
            if x.requires_grad:  # the embedding's input is integer ids: no gradient to hook
                x.register_hook(lambda _grad: self._backward_exit(name))
        return hook

    def _exit(self, name: str):
        def hook(_module, _args, output):
            self._mark(name, "fwd1")
            if output.requires_grad and name != EMBED:  # the embedding's backward is timed to the end
                output.register_hook(lambda _grad: self._backward_enter(name))
        return hook

    def _backward_enter(self, name: str) -> None:
        if self.clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._mark(name, "bwd0")

    def _backward_exit(self, name: str) -> None:
        self._mark(name, "bwd1")
        if self.clock.cuda:
            self.peaks[name] = torch.cuda.max_memory_allocated()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # a storage is counted once, in the layer that first saved it; weights are not activations
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self._weights and ptr not in self._seen:
            self._seen.add(ptr)
            self.saved[self.current] = self.saved.get(self.current, 0) + tensor.untyped_storage().nbytes()
        return tensor

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


class _Step:
    """One training step of ``model`` on fixed random ids, with or without a recorder."""

    def __init__(self, model, batch_size: int, seq_len: int, precision: str, seed: int = 0):
        self.model = model
        self.device = model.model.embed_tokens.weight.device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(0, model.arch.vocab_size, (batch_size, seq_len + 1), generator=gen)
        self.inputs, self.targets = ids[:, :-1].to(self.device), ids[:, 1:].to(self.device)
        self.precision = precision
        self.chunk = min(seq_len, 256)  # the schema's default loss_chunk_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-12)  # the step's cost, not its learning

    def __call__(self, rec: _Recorder | None = None) -> None:
        clock = rec.clock if rec else None
        self.optimizer.zero_grad(set_to_none=True)
        saving = (torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t) if rec
                  else contextlib.nullcontext())
        with saving, _autocast(self.device, self.precision):
            hidden = self.model.hidden_states(self.inputs)
            if rec:
                rec.current = HEAD
                rec.marks[(HEAD, "fwd0")] = clock.mark()
            loss = self.model.loss(hidden, self.targets, chunk_size=self.chunk)
            if rec:
                rec.marks[(HEAD, "fwd1")] = clock.mark()
        if rec:
            rec.marks[("backward", "start")] = clock.mark()
        loss.backward()
        if rec:
            rec.marks[("backward", "end")] = clock.mark()
        self.optimizer.step()
        if rec:
            rec.marks[(OPTIMIZER, "end")] = clock.mark()


def _rows(rec: _Recorder, n_layers: int) -> list[LayerRow]:
    """Turn the marks of one profiled step into rows. The head's backward runs from the start of
    the backward to the last block's; the embedding's from the first block's end to the end."""
    m, sec = rec.marks, rec.clock.seconds
    first, last = "layers.0", f"layers.{n_layers - 1}"
    rows = [LayerRow(EMBED, sec(m[(EMBED, "fwd0")], m[(EMBED, "fwd1")]),
                     sec(m[(first, "bwd1")], m[("backward", "end")]), rec.saved.get(EMBED, 0))]
    for i in range(n_layers):
        name = f"layers.{i}"
        rows.append(LayerRow(name, sec(m[(name, "fwd0")], m[(name, "fwd1")]), sec(m[(name, "bwd0")], m[(name, "bwd1")]),
                             rec.saved.get(name, 0), rec.peaks.get(name)))
    rows.append(LayerRow(HEAD, sec(m[(HEAD, "fwd0")], m[(HEAD, "fwd1")]),
                         sec(m[("backward", "start")], m[(last, "bwd0")]), rec.saved.get(HEAD, 0)))
    return rows


def _median_rows(runs: list[list[LayerRow]]) -> list[LayerRow]:
    out = []
    for rows in zip(*runs, strict=True):
        out.append(LayerRow(rows[0].name, statistics.median(r.forward_s for r in rows),
                            statistics.median(r.backward_s for r in rows), rows[-1].saved_bytes,
                            rows[-1].backward_peak_bytes))
    return out


def _timed(step: _Step, clock: Clock, rec: _Recorder | None) -> float:
    clock.sync()
    t0 = time.perf_counter()
    step(rec)
    clock.sync()
    return time.perf_counter() - t0


def _extra_flop_formulas():
    """Formulas torch's counter lacks: the CPU attention kernel (it knows flash / memory-efficient
    on CUDA only; key and value heads counted as repeated for GQA, as the kernel attends them) and
    the in-place ``addmm_`` the chunked LM head accumulates its weight gradient with."""
    def heads(q, t):
        return (t[0], q[1], t[2], t[3])

    def forward(q, k, v, *_args, out_val=None, **_kwargs):
        return sdpa_flop_count(q, heads(q, k), heads(q, v))

    def backward(grad, q, k, v, *_args, out_val=None, **_kwargs):
        return sdpa_backward_flop_count(grad, q, heads(q, k), heads(q, v))

    def addmm_inplace(acc, a, b, *_args, out_val=None, **_kwargs):
        return addmm_flop(acc, a, b)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward, aten.addmm_: addmm_inplace}


def count_flops(step: _Step) -> tuple[int, dict[str, int]]:
    """FLOPs of one step as torch's flop counter sees them (matmuls and attention), by op."""
    with FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas()) as counter:
        step()
    by_op = {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    return int(counter.get_total_flops()), by_op


def kernel_time(step: _Step, wall_s: float, top: int = 5) -> dict:
    """GPU only: the device time of one step's kernels (torch.profiler), its share of the step's
    wall time (device utilisation) and the kernels that took longest."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total_s = sum(e.self_device_time_total for e in kernels) / 1e6
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return {"kernel_s": total_s, "utilisation": min(total_s / wall_s, 1.0) if wall_s > 0 else None,
            "top": [{"name": e.key[:120], "calls": e.count, "s": e.self_device_time_total / 1e6}
                    for e in kernels[:top]]}


def profile_step(model, *, batch_size: int, seq_len: int, precision: str = "fp32", steps: int = 3) -> StepProfile:
    """Measure ``steps`` profiled steps interleaved with as many unprofiled ones (after one warm-up
    step), then count one step's FLOPs and, on a GPU, its kernel time. ``model`` is trained in
    place at a learning rate of 1e-12 (its weights barely move; pass a copy to keep them)."""
    model.train()
    step = _Step(model, batch_size, seq_len, precision)
    clock = Clock(step.device)
    _timed(step, clock, None)  # warm-up: allocator, AdamW state, kernels chosen
    plain, profiled, runs, optimizer = [], [], [], []
    for _ in range(steps):
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        plain.append(_timed(step, clock, None))
        peak = torch.cuda.max_memory_allocated() if clock.cuda else None
        rec = _Recorder(model, clock)
        try:
            profiled.append(_timed(step, clock, rec))
        finally:
            rec.remove()
        runs.append(_rows(rec, len(model.model.layers)))
        optimizer.append(clock.seconds(rec.marks[("backward", "end")], rec.marks[(OPTIMIZER, "end")]))
    flops, by_op = count_flops(step)
    unprofiled = statistics.median(plain)
    kernels = kernel_time(step, unprofiled) if clock.cuda else None
    return StepProfile(
        device=str(step.device), precision=precision, batch_size=batch_size, seq_len=seq_len,
        layers=_median_rows(runs), step_s=statistics.median(profiled), unprofiled_step_s=unprofiled, steps=steps,
        optimizer_s=statistics.median(optimizer), counted_flops=flops, counted_by_op=by_op, peak_bytes=peak,
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()), kernels=kernels,
        profiled_samples_s=profiled, unprofiled_samples_s=plain)
