"""One training step (forward, loss, backward, AdamW) measured layer by layer.

The step is the model's own: ``LlamaForCausalLM.hidden_states`` then ``LlamaForCausalLM.loss`` (the
loss entry point every engine calls), under plain autograd, with the run's precision as autocast.
Per layer it records forward and backward time (module hooks putting marks on a ``Clock``), the
bytes autograd saves for the backward (a ``saved_tensors_hooks`` pack hook; weights excluded) and,
on a GPU, the peak memory while the layer's backward runs. The timing hooks are the only thing the
profiled step adds, and the unprofiled steps of the same run measure what they cost; bytes and
peaks are counted on one more step, which is not timed (its pack hook runs per saved tensor).
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
    """The hooks: forward and backward marks per layer and, with ``memory``, the bytes autograd saves
    per layer (a pack hook) and each layer's backward peak on a GPU.

    Timing takes as few Python calls as the marks need (docs/design.md, "Drift, histograms and the
    profiler's cost"): a layer's input is the previous layer's output, so one forward pre-hook per
    layer marks both the previous module's end and this layer's start (and a forward hook on the
    last layer its end), and one gradient hook on each layer's input marks both this layer's
    backward end and the previous layer's backward start (and one on the last layer's output its
    backward start). The pack hook runs once per saved tensor, the most of any hook, so memory is
    counted on a step of its own that is not timed."""

    def __init__(self, model, clock: Clock, memory: bool = False):
        self.clock, self.memory = clock, memory
        self.marks: dict[tuple[str, str], object] = {}
        self.saved: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.current = EMBED
        self._seen: set[int] = set()
        self._weights = {p.untyped_storage().data_ptr() for p in model.parameters()} if memory else set()
        layers = list(model.model.layers)
        self._names = [f"layers.{i}" for i in range(len(layers))]
        self._handles = [model.model.embed_tokens.register_forward_pre_hook(self._enter_embedding)]
        for i, module in enumerate(layers):
            self._handles.append(module.register_forward_pre_hook(self._enter(i)))
        self._handles.append(layers[-1].register_forward_hook(self._exit_last))

    def _enter_embedding(self, _module, _args) -> None:
        self.marks[(EMBED, "fwd0")] = self.clock.mark()

    def _enter(self, i: int):
        name, previous = self._names[i], (self._names[i - 1] if i else EMBED)

        def hook(_module, args):
            self.current = name
            self.marks[(name, "fwd0")] = self.marks[(previous, "fwd1")] = self.clock.mark()
            x = args[0]
            if x.requires_grad:  # its gradient is computed: this layer's backward ends, the previous one's starts
                x.register_hook(lambda _grad: self._input_grad(i))
        return hook

    def _exit_last(self, _module, _args, output) -> None:
        name = self._names[-1]
        self.marks[(name, "fwd1")] = self.clock.mark()
        if output.requires_grad:
            output.register_hook(lambda _grad: self._backward_enter(name))

    def _backward_enter(self, name: str) -> None:
        if self.memory and self.clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.marks[(name, "bwd0")] = self.clock.mark()

    def _input_grad(self, i: int) -> None:
        mark = self.clock.mark()
        self.marks[(self._names[i], "bwd1")] = mark
        if self.memory and self.clock.cuda:
            self.peaks[self._names[i]] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if i:
            self.marks[(self._names[i - 1], "bwd0")] = mark

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
        saving = (torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t) if rec and rec.memory
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


def _median_rows(runs: list[list[LayerRow]], memory: list[LayerRow]) -> list[LayerRow]:
    """Each layer's median times over the timed steps, its bytes from the memory step."""
    out = []
    for rows, counted in zip(zip(*runs, strict=True), memory, strict=True):
        out.append(LayerRow(rows[0].name, statistics.median(r.forward_s for r in rows),
                            statistics.median(r.backward_s for r in rows), counted.saved_bytes,
                            counted.backward_peak_bytes))
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
    rec = _Recorder(model, clock, memory=True)  # saved bytes and backward peaks: a step of their own, untimed
    try:
        step(rec)
        clock.sync()
    finally:
        rec.remove()
    memory = _rows(rec, len(model.model.layers))
    flops, by_op = count_flops(step)
    unprofiled = statistics.median(plain)
    kernels = kernel_time(step, unprofiled) if clock.cuda else None
    return StepProfile(
        device=str(step.device), precision=precision, batch_size=batch_size, seq_len=seq_len,
        layers=_median_rows(runs, memory), step_s=statistics.median(profiled), unprofiled_step_s=unprofiled,
        steps=steps,
        optimizer_s=statistics.median(optimizer), counted_flops=flops, counted_by_op=by_op, peak_bytes=peak,
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()), kernels=kernels,
        profiled_samples_s=profiled, unprofiled_samples_s=plain)
