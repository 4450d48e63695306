"""`apr train plan CONFIG --trace`: run the resolved engine on fake tensors and set the bytes it holds
beside the plan's memory table (docs/plan.md, "Trace").

The engine apply would build (``apr.train.build.build_engine`` with the plan's ``Resolved``) is built
under torch's ``FakeTensorMode``: every tensor has its shape, dtype and device but no storage, so a 7B
step costs seconds and a few hundred MiB of host memory. Under ``training.sharding`` with N ranks the
trace is rank 0 of N on a fake process group (``FakeStore``, backend ``fake``): collectives return at
once and each rank's tensors are its own shards. Two steps run: the first allocates what is created
lazily (torch AdamW's moments, FSDP2's lazy init), the second is the one measured.

The bytes are counted as ``torch.distributed._tools.mem_tracker.MemTracker`` counts them (a dispatch
mode that holds a weak reference to each new storage and subtracts it when the storage dies,
``resize_`` patched for FSDP2's gathered parameters), but attributed to the plan's rows rather than
MemTracker's parameter/activation classes, which cannot see the walk's flat buffers:

* the buffer-plan tensors the engine allocates by name, each model parameter and its gradient, and
  torch AdamW's state are tagged by identity (weights, compute copy, gradients, moments);
* a tensor created during the step is tagged by where it was made: inside the LM-head loss (the
  logits chunk and its head hidden states), inside an optimizer update or clipping (temporaries),
  anywhere else in the forward and backward (activations);
* FSDP2's all-gathered weights and unsharded gradients are weights and gradients (as the buffer plan
  declares them).

Device-only memory (the CUDA context, the allocator's slack) has no tensor: those rows stay modelled
and are labelled so. A CPU-only torch traces on the CPU device, whose attention kernels are not the
GPU's: the report says which device was traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import resource
import sys
import time
import weakref
from collections.abc import Callable

from apr.errors import AprError, Finding
from apr.steps import distill as distill_schedule
from apr.steps.execution import Execution

# (trace row, the plan's memory-table components it is compared with, label)
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("weights", ("weights", "frozen_weights", "adapters"), "weights (fp32 masters, frozen base, adapters)"),
    ("compute_weights", ("compute_weights",), "compute copy of the blocks' weights"),
    ("gradients", ("gradients",), "gradients or gradient workspace"),
    ("moments", ("adamw_m", "adamw_v"), "AdamW moments"),
    ("activations", ("activation_checkpoints", "kept_activations", "block_activations"),
     "activations (checkpoints, kept graphs, one block)"),
    ("logits_chunk", ("logits_chunk", "kd_logits"), "LM-head loss (logits chunks, head hidden states)"),
    ("inputs", ("inputs",), "token ids"),
    ("canonical", ("canonical_leaves",), "canonical's gradient leaves (plan: beyond the rows above, at the peak)"),
    ("teacher", ("teacher_weights",), "the frozen distillation teacher"),
    ("temporaries", (), "optimizer and clipping temporaries (not in the plan)"),
    ("other", (), "other: rope tables, flags, scaler (not in the plan)"),
]
MODELLED = ("cuda_context", "allocator_slack")  # device-only: no tensor to trace
DEFAULT_TIMEOUT_S = 600.0


class TraceTimeout(Exception):
    pass


def _trace_error(message: str, code: str, **kw) -> AprError:
    return AprError(message, [Finding("error", code, message, **kw)])


# ------------------------------------------------------------------------------------- the counter


def _counter_class():
    """The dispatch mode, defined once torch is imported (this module stays torch-free)."""
    import torch
    from torch.distributed._tensor import DTensor
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    class RowCounter(TorchDispatchMode):
        """Live bytes by row, each row's peak, and the total's peak with the rows at that moment."""

        def __init__(self, deadline: float):
            super().__init__()
            self.deadline = deadline
            self.info = WeakIdKeyDictionary()  # storage -> [row, nbytes]
            self.refs: list = []
            self.current = dict.fromkeys((r for r, _, _ in ROWS), 0)
            self.total = 0
            self.region = "other"
            self.phase = "building the engine"
            self.ops = 0
            self.expired = ""  # the phase the deadline passed in, until a safe point raises it
            self.vocab = -1  # the vocabulary: a tensor this wide is logits, wherever it is made
            self.reset_peaks()
            self._orig_resize = torch.UntypedStorage.resize_

        def reset_peaks(self) -> None:
            self.row_peak = dict(self.current)
            self.peak = self.total
            self.at_peak = dict(self.current)

        def _add(self, row: str, nbytes: int) -> None:
            self.current[row] += nbytes
            self.total += nbytes
            if self.current[row] > self.row_peak[row]:
                self.row_peak[row] = self.current[row]
            if self.total > self.peak:
                self.peak = self.total
                self.at_peak = dict(self.current)

        def _dead(self, entry, _ref) -> None:
            self._add(entry[0], -entry[1])
            entry[1] = 0

        def track(self, st, row: str, retag: bool = False) -> None:
            entry = self.info.get(st)
            if entry is None:
                entry = [row, st.nbytes()]
                self.info[st] = entry
                self.refs.append(weakref.ref(st, lambda r, e=entry: self._dead(e, r)))
                self._add(row, entry[1])
            elif retag and entry[0] != row:
                self._add(entry[0], -entry[1])
                entry[0] = row
                self._add(row, entry[1])

        def tag(self, tensor, row: str) -> None:
            """Attribute ``tensor``'s storage (a DTensor's local shard) to ``row``."""
            if tensor is None:
                return
            for st in get_untyped_storages(tensor):
                self.track(st, row, retag=True)

        def expire(self, *_args) -> None:
            """A safe point: raise ``TraceTimeout`` once the deadline has passed. Called from Python
            only (a module's forward pre-hook outside the backward, the step loop), never from inside
            an operation or the autograd engine."""
            if self.expired and torch._C._current_autograd_node() is None:
                phase, self.expired = self.expired, ""
                raise TraceTimeout(phase)

        @contextlib.contextmanager
        def in_region(self, row: str):
            before, self.region = self.region, row
            try:
                yield
            finally:
                self.region = before

        def __enter__(self):
            counter = self

            def resize_(st, size):  # FSDP2 frees and re-allocates its gathered weights by resizing
                counter._orig_resize(st, size)
                entry = counter.info.get(st)
                if entry is None:
                    counter.track(st, "weights")
                elif entry[1] != st.nbytes() or entry[0] != "weights":
                    counter._add(entry[0], -entry[1])
                    entry[0], entry[1] = "weights", st.nbytes()
                    counter._add("weights", entry[1])

            torch.UntypedStorage.resize_ = resize_
            return super().__enter__()

        def __exit__(self, *args):
            torch.UntypedStorage.resize_ = self._orig_resize
            return super().__exit__(*args)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor or issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor run its local ops, which come back here
            self.ops += 1
            if self.ops % 256 == 0 and time.monotonic() > self.deadline:
                # never raised here: an exception thrown out of a dispatched operation can abort the
                # process (C++ unwinding through autograd); the next safe point raises it (`expire`)
                self.deadline, self.expired = float("inf"), self.phase
            if func is torch.ops.aten._local_scalar_dense.default:
                # a host read (the standard engine's loss check, the fp16 scaler): a finite value
                dtype = args[0].dtype
                return True if dtype == torch.bool else 1 if not dtype.is_floating_point else 1.0
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                    row = self.region
                    if row == "activations" and t.dim() >= 2 and t.shape[-1] == self.vocab:
                        row = "logits_chunk"  # a loss's logits gradient, made in the backward outside the loss
                    for st in get_untyped_storages(t):
                        if st not in self.info:
                            self.track(st, row)
            return out

    return RowCounter


# ------------------------------------------------------------------------------------- the build


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _env(name: str, value: str):

    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _fake_model_builder(device):
    """``build_model_for`` for fake tensors: the model made on ``device`` directly, no random init
    (values do not change the bytes), no ``init_from`` read; LoRA and a stacking trunk as apply
    makes them."""
    import torch

    from apr.model.llama import LlamaForCausalLM
    from apr.model.lora import add_adapters
    from apr.model.trunk import apply_trunk
    from apr.steps import stacking

    def build(config, seed):
        with torch.device(device):
            model = LlamaForCausalLM(config.model.architecture)
        if config.model.lora is not None:
            add_adapters(model, config.model.lora, seed)
        if stacking.trunk_storage(config):
            apply_trunk(model, config, seed)
        return model

    return build


def _fake_teacher(device):
    """``apr.train.distill.load_teacher`` for fake tensors: the teacher's architecture read from its
    source, the model made on ``device``, frozen, no weights read."""
    import torch

    from apr.checkpoint.hf_import import source_architecture
    from apr.model.llama import LlamaForCausalLM

    def load(config, _device):
        with torch.device(device):
            teacher = LlamaForCausalLM(source_architecture(config.training.distill.teacher))
        teacher.requires_grad_(False)
        return teacher.eval()

    return load


def _to_if_moved(original):
    """``nn.Module.to`` that returns the module as it is when nothing moves: a fake parameter cannot
    be swapped for itself (``build_engine`` moves the model to the device it was made on)."""
    import torch

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if dtype is None and all(device is None or t.device == torch.device(device) for t in tensors):
            return self
        return original(self, *args, **kwargs)

    return to


def _real(fn):
    """``fn`` run outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def call(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return call


def _fake_process_group(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from apr.train.dist import DataParallel

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return DataParallel(rank=0, world_size=world_size, local_rank=0, backend="fake")


def trace_device(config) -> tuple[str, str]:
    """The device the trace runs on and why: a GPU run on a CPU-only torch traces on the CPU."""
    import torch

    wanted = str(config.training.device)
    if wanted == "cpu":
        return "cpu", "training.device is cpu"
    if torch.cuda.is_available():
        return "cuda", "fake CUDA tensors"
    return "cpu", (f"this torch ({torch.__version__}) has no CUDA: traced on the CPU device, whose attention "
                   "and autocast kernels can differ from the GPU's")


# ------------------------------------------------------------------------------------- the trace


def _tag_state(counter, engine, planned: dict[str, str]) -> None:
    """Tag the engine's persistent tensors by identity: buffer-plan buffers by name, parameters and
    their gradients, torch AdamW's state."""
    import torch

    for name, tensor in (getattr(engine.gradients, "buffers", None) or {}).items():
        counter.tag(tensor, _row_of(planned.get(name, "")))
    for _, p in engine.model.named_parameters():
        entry = [counter.info.get(st) for st in _storages(p)]
        if not all(e is not None and e[0] != "other" for e in entry):  # not already a named buffer
            counter.tag(p, "weights")
        if p.grad is not None:
            counter.tag(p.grad, "gradients")
    optimizer = getattr(getattr(engine, "updater", None), "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    counter.tag(value, "moments" if key in ("exp_avg", "exp_avg_sq") else "other")


def _tag_all(counter, module, row: str) -> None:
    for t in [*module.parameters(), *module.buffers()]:
        counter.tag(t, row)


def _storages(t):
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(t)


def _row_of(component: str) -> str:
    for row, parts, _ in ROWS:
        if component in parts:
            return row
    return "other"


def _regions(counter, engine) -> contextlib.ExitStack:
    """Mark where the step's tensors are made: the LM-head loss, the optimizer and clipping."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from apr.model import llama
    from apr.train import walk as walk_module

    stack = contextlib.ExitStack()

    def region(fn: Callable, row: str) -> Callable:
        def wrapped(*args, **kwargs):
            with counter.in_region(row):
                return fn(*args, **kwargs)
        return wrapped

    stack.enter_context(_patched(walk_module, "linear_cross_entropy_fwd_bwd",
                                 region(walk_module.linear_cross_entropy_fwd_bwd, "logits_chunk")))
    stack.enter_context(_patched(llama, "linear_cross_entropy", region(llama.linear_cross_entropy, "logits_chunk")))
    walk = engine.gradients
    if hasattr(walk, "_walk_head"):  # the walk's final norm, LM head and loss, chunk by chunk
        stack.enter_context(_patched(walk, "_walk_head", region(walk._walk_head, "logits_chunk")))
    stack.enter_context(_patched(type(engine.model), "loss", region(type(engine.model).loss, "logits_chunk")))
    if getattr(engine.loss, "kind", None) == "distill":  # phase 2: the student's logits, the teacher's
        stack.enter_context(_patched(engine.loss, "kd_loss", region(engine.loss.kd_loss, "logits_chunk")))
        stack.enter_context(_patched(engine, "hidden_states", region(engine.hidden_states, "activations")))
        _tag_all(counter, engine.loss.teacher, "teacher")
    if hasattr(engine, "updater"):
        for name in ("step", "update_group"):
            method = getattr(engine.updater, name, None)
            if callable(method):
                stack.enter_context(_patched(engine.updater, name, region(method, "temporaries")))
    # the update phase of a step that knows every gradient first (clip and the updater: apr/train/finish.py)
    src = engine.gradients
    if hasattr(src, "apply_all"):
        stack.enter_context(_patched(src, "apply_all", region(src.apply_all, "temporaries")))
    if getattr(engine, "sharded", False):  # FSDP2: what its collectives make is weights or gradients
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        for name, row in (("foreach_all_gather", "weights"), ("foreach_all_gather_copy_out", "weights"),
                          ("foreach_reduce", "gradients")):
            stack.enter_context(_patched(group, name, region(getattr(group, name), row)))
    handle = register_optimizer_step_pre_hook(lambda *a: setattr(counter, "region", "temporaries"))
    stack.callback(handle.remove)
    return stack


def run_trace(resolved, *, timeout_s: float = DEFAULT_TIMEOUT_S, plan_rows: list | None = None) -> dict:
    """Trace one rank of the run ``resolved`` (apr/steps/resolved.py) on fake tensors; returns the
    report (``peak_bytes``, ``plan_peak_bytes``, ``rows``...). ``plan_rows``: the plan's memory table
    (``MemoryRow``s) for this rank."""

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
        UnsupportedOperatorException,
    )

    from apr.memory.buffers import buffer_plan
    from apr.train import build as engine_build
    from apr.train import distill as distill_module

    config, execution = resolved.config, resolved.execution
    notes = []
    if execution.compile:  # the compiled graph is not traced: its eager blocks are
        execution = dataclasses.replace(execution, compile=False)
        notes.append("training.compile: traced eager (the compiled blocks' memory can differ)")
    if config.model.init_from is not None:
        notes.append("model.init_from not read: the trace needs shapes, not values")
    device_type, device_why = trace_device(config)
    device = torch.device(device_type)
    world = int(resolved.world_size)
    sharded = str(config.training.sharding) != "none" and world > 1
    t0 = time.monotonic()
    counter = _counter_class()(t0 + timeout_s)
    planned = {b.name: b.component for b in buffer_plan(config, execution)}
    steps_done, first_peak = 0, None
    dp = None
    try:
        if sharded or world > 1:
            dp = _fake_process_group(world)
        with contextlib.ExitStack() as stack:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(counter)
            # the timeout's safe points: every module's forward (outside the backward) and each step
            stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(counter.expire).remove)
            stack.enter_context(_patched(engine_build, "build_model_for", _fake_model_builder(device)))
            stack.enter_context(_patched(distill_module, "load_teacher", _fake_teacher(device)))
            stack.enter_context(_patched(torch.nn.Module, "to", _to_if_moved(torch.nn.Module.to)))
            if sharded:  # the device mesh's rank table is real (fake tensors cannot index it)
                from apr.train import sharded as sharded_module

                if str(config.training.sharding) == "hybrid":  # a node's ranks, as torchrun would say
                    stack.enter_context(_env("APR_SHARD_GROUP_SIZE", str(max(1, world // int(resolved.nodes)))))

                stack.enter_context(_patched(sharded_module, "init_device_mesh",
                                             _real(sharded_module.init_device_mesh)))
            engine = _build(engine_build, resolved, execution, device, dp)
            _tag_state(counter, engine, planned)
            if not sharded:
                _grad_hooks(counter, engine)
            _canonical_hooks(counter, engine)
            stack.enter_context(_regions(counter, engine))
            b, s = config.data.batch_size, config.data.seq_len
            vocab = counter.vocab = config.model.architecture.vocab_size
            lr = float(config.optimizer.lr)
            # a distillation student is traced in phase 2 (the whole student, the teacher's logits)
            first = distill_schedule.phase1_steps(config) if str(config.training.mode) == "distill" else 0
            for step in (1, 2):
                counter.expire()
                counter.phase = f"step {step} of 2" + (" (the first: lazy state)" if step == 1 else "")
                engine.current_step = first + step
                with counter.in_region("inputs"):
                    batches = [torch.randint(0, vocab, (b, s + 1), device=device)
                               for _ in range(config.training.gradient_accumulation)]
                if step == 2:
                    _tag_state(counter, engine, planned)
                    if sharded:
                        _unsharded_grad_hooks(counter, engine)
                    first_peak = counter.peak
                    counter.reset_peaks()
                with counter.in_region("activations"):
                    engine.train_step(batches, lr)
                del batches
                steps_done = step
            _tag_state(counter, engine, planned)
    except TraceTimeout as err:
        raise _trace_error(
            f"--trace stopped after {timeout_s:g} s (--trace-timeout) during {err.args[0]}, "
            f"{steps_done} of 2 steps done, {counter.ops} tensor operations run, peak so far "
            f"{counter.peak / 2**30:.2f} GiB", "plan.trace_timeout", path="--trace-timeout",
            expected=f"the trace within {timeout_s:g} s", got=f"stopped during {err.args[0]}") from None
    except (UnsupportedOperatorException, DataDependentOutputException, DynamicOutputShapeException) as err:
        op = getattr(err, "func", None)
        raise _trace_error(
            f"--trace: fake tensors cannot run {op} ({type(err).__name__}) during {counter.phase}",
            "plan.trace_unsupported", expected="operations fake tensors can run", got=str(op)) from None
    except AprError:
        raise
    except Exception as err:
        raise _trace_error(f"--trace failed during {counter.phase}: {type(err).__name__}: {err}".strip(),
                           "plan.trace_failed", expected="an engine that builds and steps on fake tensors",
                           got=type(err).__name__) from None
    finally:
        if dp is not None and dist.is_initialized():
            dist.destroy_process_group()
    seconds = time.monotonic() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    plan_rows = plan_rows or []
    own = {}
    if any(r.component == "block_activations" for r in plan_rows):
        # the activations row's own peak is its block phase whole; the table's block row is only the
        # excess over the loss phase (which is what the step's peak sums)
        from apr.memory.activations import block_activation_bytes, kept_activation_bytes

        own["activations"] = (sum(r.bytes for r in plan_rows if r.component == "activation_checkpoints")
                              + kept_activation_bytes(config, execution)
                              + block_activation_bytes(config, execution=execution))
    if sharded and config.model.lora is None:
        own["weights"] = _sharded_weights_peak(config, plan_rows)
    return report(counter, plan_rows, own, device=device_type, device_why=device_why, world_size=world,
                  nodes=int(resolved.nodes), sharding=str(config.training.sharding), seconds=seconds,
                  rss=rss, first_peak=first_peak, notes=notes, torch_version=torch.__version__)


def _sharded_weights_peak(config, plan_rows: list) -> int:
    """FSDP2: the weights row's own peak. It is at the root unit's all-gather, the flat output beside
    the gathered root (and under ``shard_grad_op`` the first block gathered beside its own output)
    before the forward has made any activation: a transient the step's peak never sees. Under
    ``shard_grad_op`` the whole gathered model, at the step's peak, is the larger on a deep model."""
    from apr.model.spec import group_sizes

    sizes = dict(group_sizes(config))
    root = 4 * (sizes.get("embed", 0) + sizes.get("head", 0))
    weights = sum(r.bytes for r in plan_rows if r.component in ("weights", "frozen_weights", "adapters"))
    if str(config.training.sharding) != "shard_grad_op":
        return weights + root
    block = 4 * max((n for name, n in sizes.items() if name.startswith("block.")), default=0)
    gathered = 4 * sum(sizes.values()) + block  # the plan's gathered model and a block's all-gather output
    return max(weights, weights - gathered + 2 * root + 2 * block)


def _build(engine_build, resolved, execution, device, dp):
    """``build_engine`` as apply calls it: from the plan's ``Resolved`` (or, on the older signature,
    from its config and execution)."""

    first = next(iter(inspect.signature(engine_build.build_engine).parameters))
    if first == "plan":
        return engine_build.build_engine(dataclasses.replace(resolved, execution=execution), device, dp=dp)
    return engine_build.build_engine(resolved.config, device, dp=dp, execution=execution)


def _unsharded_grad_hooks(counter, engine) -> None:
    """FSDP2: a gathered parameter's gradient (before its reduce-scatter) is a gradient."""
    for module in engine.model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        for fsdp_param in getattr(group, "fsdp_params", []):
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None and param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda q: counter.tag(q.grad, "gradients"))


def _canonical_hooks(counter, engine) -> None:
    """``training.reduction: canonical``: each micro-batch's gradient leaf, as the source hands it to the
    canonical sum (apr/train/reduction.py), is canonical's row."""
    for owner in (engine.layout, engine.gradients):
        total = getattr(owner, "canonical", None)
        if total is None:
            continue

        def take(*args, _take=total.take, _total=total, **kwargs):
            _take(*args, **kwargs)
            counter.tag(_total.leaves[-1], "canonical")

        total.take = take


def _grad_hooks(counter, engine) -> None:
    """Plain autograd: a parameter's gradient is a gradient from the moment autograd stores it."""
    for p in engine.model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: counter.tag(q.grad, "gradients"))


def report(counter, plan_rows: list, own: dict[str, int], **facts) -> dict:
    """The trace beside the plan: per row the plan's bytes, the traced row's peak and its bytes at the
    total's peak; the modelled device-only rows as they are."""
    by_component = {r.component: r.bytes for r in plan_rows}
    rows = []
    for row, parts, label in ROWS:
        plan_bytes = own.get(row, sum(by_component.get(c, 0) for c in parts)) if parts else None
        traced = counter.row_peak[row]
        if plan_bytes is None and traced == 0:
            continue
        if plan_bytes == 0 and traced == 0:
            continue
        rows.append({"name": row, "label": label, "plan_bytes": plan_bytes, "traced_bytes": traced,
                     "at_peak_bytes": counter.at_peak[row], "source": "traced",
                     "ratio": (plan_bytes / traced) if plan_bytes and traced else None})
    for name in MODELLED:
        if name in by_component:
            rows.append({"name": name, "label": "(modelled: no tensor to trace)", "plan_bytes": by_component[name],
                         "traced_bytes": None, "at_peak_bytes": None, "source": "modelled", "ratio": None})
    plan_peak = sum(r.bytes for r in plan_rows if r.component not in MODELLED)
    return {"peak_bytes": counter.peak, "plan_peak_bytes": plan_peak,
            "ratio": plan_peak / counter.peak if counter.peak else None,
            "first_step_peak_bytes": facts.pop("first_peak"), "rows": rows, **facts}


def trace_plan(plan, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """``apr train plan --trace``: trace rank 0 of the plan's resolved run against its memory table;
    with ``--probe`` (the plan's ``facts.probe``), also the trace beside the probe's measurement."""
    traced = run_trace(plan.resolved, timeout_s=timeout_s, plan_rows=plan.memory)
    probe = plan.facts.get("probe")
    if probe:
        traced["probe"] = beside_probe(plan, traced, probe, timeout_s=timeout_s)
    return traced


def beside_probe(plan, traced: dict, probe: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """The trace of what the probe built (one unsharded process: the plan's own trace, or on more
    ranks one more trace) beside the probe's real memory: the tensors both count, then what only a
    device holds (the allocator's reserve beyond its tensors, the CUDA context and libraries'
    workspaces), each beside the plan's modelled row; on the CPU, the process's resident set."""
    from apr.memory.table import memory_table
    from apr.steps.resolved import resolve

    rows, retraced = plan.memory, int(plan.resolved.world_size) > 1
    if retraced:  # the probe is one unsharded process (apr/probe.py): trace that too
        tr = plan.config.training
        one = plan.config.model_copy(update={"training": tr.model_copy(update={"world_size": 1, "sharding": "none"})})
        execution = Execution.from_dict(plan.execution["policy"], one.model.architecture.num_hidden_layers)
        rows = memory_table(one, execution=execution)
        traced = run_trace(resolve(one, execution=execution), timeout_s=timeout_s, plan_rows=rows)
    modelled = {r.component: r.bytes for r in rows if r.component in MODELLED}
    memory = probe.get("device_memory") or {}
    out = [_beside("tensors", "tensors at the step's peak", traced["plan_peak_bytes"], traced["peak_bytes"],
                   memory.get("tensor_peak_bytes"))]
    if probe["device"] == "cuda":
        reserve = memory["reserved_peak_bytes"] - memory["tensor_peak_bytes"]
        out += [_beside("allocator_slack", "allocator's reserve beyond its tensors (peak)",
                        modelled.get("allocator_slack"), None, reserve),
                _beside("cuda_context", "outside the allocator: CUDA context, libraries",
                        modelled.get("cuda_context"), None, memory["outside_allocator_bytes"]),
                _beside("device", "device memory in use at the step's peak",
                        traced["plan_peak_bytes"] + sum(modelled.values()), None,
                        memory["reserved_peak_bytes"] + memory["outside_allocator_bytes"])]
    else:
        out.append(_beside("process", "process peak RSS (tensors, interpreter, libs)",
                           None, None, probe["peak_rss_bytes"]))
    return {"device": probe["device"], "device_name": probe.get("device_name"), "rows": out,
            "one_process_trace": retraced, "how": memory.get("how")}


def _beside(name: str, label: str, plan_bytes, traced_bytes, measured_bytes) -> dict:
    def ratio(a, b):
        return a / b if a and b else None

    return {"name": name, "label": label, "plan_bytes": plan_bytes, "traced_bytes": traced_bytes,
            "measured_bytes": measured_bytes, "plan_ratio": ratio(plan_bytes, measured_bytes),
            "trace_ratio": ratio(traced_bytes, measured_bytes)}
