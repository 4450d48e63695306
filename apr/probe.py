"""`apr train plan CONFIG --probe`: build the real engine on the run's device and measure a few steps
on synthetic token ids of the config's shapes (docs/plan.md, "Probe";
docs/design.md, "Probe and calibration"). Nothing is written to the run's output folder: the probe records its result in
the global registry's calibration table only (apr/track/calibration.py).

Measured:
- each buffer-plan component the engine allocates (weights, moments, gradients, compute copy):
  the bytes of the tensors actually allocated, beside the plan's row;
- the step's transient memory (activations, checkpoints, logits chunks, scratch): on CUDA the
  allocator's peak minus what was allocated before the step; on the CPU the peak of live tensor
  storage created during one step, tracked op by op (``_LiveBytes``), plus the process's peak RSS;
- step time (median of the timed steps, and each step: their spread is the estimate's range),
  tokens/s, the start-up apply would see (imports, plan, engine, the first step's extra), at the
  thread count apply would use (apr/threads.py) and the load average before it began.

A layer of its own above ``apr.train`` (like ``apr.lrfind``): the plan package stays torch-free.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import statistics
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from apr import STARTED_AT, __version__
from apr.errors import AprError, Finding
from apr.memory.buffers import buffer_plan
from apr.memory.table import memory_table
from apr.steps.execution import Execution
from apr.steps.resolved import resolve
from apr.threads import apply_thread_policy
from apr.track.calibration import host_cpu_name
from apr.train import build as engine_build
from apr.train import engine as engine_module
from apr.train.calibrate import compile_seconds

STARTUP_MAX_S = 300.0  # longer since the process started: it is not a CLI's start-up
TRANSIENT = ("activation_checkpoints", "kept_activations", "block_activations", "logits_chunk", "inputs")


class _LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storage made by the ops run under it (CPU tensors), each storage
    counted until it is freed (a weak reference's callback, as torch's MemTracker counts). ``step()``
    starts a step: ``peak`` is then the step's highest total, ``step_peak`` the highest of what
    the step itself made (its transient)."""

    def __init__(self):
        super().__init__()
        self.sizes = WeakIdKeyDictionary()  # storage -> [nbytes, made during the step]
        self.refs: list = []
        self.current = self.peak = self.step_current = self.step_peak = self.before = 0
        self.in_step = False

    def step(self) -> None:
        self.in_step, self.before, self.peak = True, self.current, self.current
        self.step_current = self.step_peak = 0

    def _freed(self, entry: list) -> None:
        self.current -= entry[0]
        if entry[1]:
            self.step_current -= entry[0]
        entry[0] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            if storage in self.sizes or not storage.nbytes():
                continue
            entry = [storage.nbytes(), self.in_step]
            self.sizes[storage] = entry
            self.refs.append(weakref.ref(storage, lambda _ref, e=entry: self._freed(e)))
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
            if self.in_step:
                self.step_current += entry[0]
                self.step_peak = max(self.step_peak, self.step_current)
        return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return host_cpu_name()


def _probe_error(message: str, code: str, **kw) -> AprError:
    return AprError(message, [Finding("error", code, message, **kw)])


def _resolve(config) -> torch.device:
    name = str(config.training.device)
    if name == "cuda" and not torch.cuda.is_available():
        raise _probe_error("--probe: training.device is cuda, but this machine has no CUDA device; probe on the "
                           "machine that will train, or set training.device=cpu", "probe.device",
                           path="training.device", expected="a CUDA device", got="none")
    return engine_module.resolve_device(name)


def _synthetic(config, gen: torch.Generator) -> list[torch.Tensor]:
    b, s, v = config.data.batch_size, config.data.seq_len, config.model.architecture.vocab_size
    return [torch.randint(0, v, (b, s + 1), generator=gen) for _ in range(config.training.gradient_accumulation)]


def one_process_rows(config, execution_policy: dict) -> dict[str, int]:
    """The plan's bytes by component for what the probe builds: one unsharded process. A plan at
    several ranks models one rank's shards (``training.sharding``) or data parallelism's second
    gradient workspace instead, which a single process cannot measure."""
    tr = config.training
    one = config.model_copy(update={"training": tr.model_copy(update={"world_size": 1, "sharding": "none"})})
    execution = Execution.from_dict(execution_policy, config.model.architecture.num_hidden_layers)
    return {r.component: r.bytes for r in memory_table(one, execution=execution)}


def run_probe(config, execution_policy: dict, modelled: dict[str, int], steps: int = 3, world_size: int = 1) -> dict:
    """Build the engine under the plan's execution policy and measure ``steps`` timed steps (after
    one warm-up step, and one step measured for memory). ``modelled``: the plan's rows by component.
    The probe runs at the intra-op threads one of ``world_size`` ranks would get (apr/threads.py),
    and records them with the load average before it started."""
    device = _resolve(config)
    # inductor points TORCHINDUCTOR_CACHE_DIR at its own default when it first compiles: the plan
    # this probe serves then looks at the cache apply would use, not at that one (issue 54 item 8)
    user_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        return _run_probe(config, device, execution_policy, modelled, steps, world_size)
    finally:
        if user_cache is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = user_cache


def _cuda_memory(device: torch.device) -> dict:
    """The device's memory after one step: the allocator's peaks, and what the device holds beyond
    the allocator's reserve (the CUDA context, libraries' own workspaces, any other process)."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"tensor_peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "reserved_peak_bytes": int(torch.cuda.max_memory_reserved(device)),
            "device_used_bytes": int(total - free), "outside_allocator_bytes": int(total - free - reserved),
            "how": "CUDA allocator's peaks during one step (allocated, reserved); the device's memory in use "
                   "after it (cudaMemGetInfo), less the allocator's reserve, is outside the allocator"}


def _memory_step(engine, device, batch, lr: float, live, counted_all: bool) -> tuple[int, str, dict]:
    """One step measured for memory: (its transient bytes, how, the device memory facts);
    ``counted_all``: ``live`` has counted every tensor since the engine's build."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        engine.train_step(batch, lr)
        torch.cuda.synchronize(device)
        memory = _cuda_memory(device)
        return (memory["tensor_peak_bytes"] - before,
                "CUDA allocator peak during one step, minus what was allocated before it", memory)
    with live:
        live.step()
        engine.train_step(batch, lr)
    memory = {"tensor_peak_bytes": live.peak if counted_all else None,
              "how": "the peak of live tensor storage during one step, every tensor counted op by op from the "
                     "engine's build" if counted_all else
                     "compiled blocks: only the step's own tensors were counted, not the whole peak"}
    return live.step_peak, "peak of live tensor storage created during one step (tracked op by op)", memory


def _run_probe(config, device, execution_policy: dict, modelled: dict[str, int], steps: int,
               world_size: int) -> dict:
    thread_choice = apply_thread_policy(config, world_size)
    began = time.time()
    arch = config.model.architecture
    execution = Execution.from_dict(execution_policy, arch.num_hidden_layers)
    phase, step = "building the engine", 0
    t_start = time.perf_counter()
    # on the CPU every tensor is counted from the build on, so that the memory step's peak is the
    # process's tensors (--trace's peak); blocks are not compiled under a dispatch mode, so compiled
    # ones are counted in the memory step alone
    live = _LiveBytes() if device.type == "cpu" else None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with live if live is not None and not execution.compile else contextlib.nullcontext():
            engine = engine_build.build_engine(resolve(config, execution=execution), device)
            gen = torch.Generator().manual_seed(0)
            lr = float(config.optimizer.lr)
            phase, step = "the warm-up step", 1
            t_warm = time.perf_counter()
            engine.train_step(_synthetic(config, gen), lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # apply's start-up as this process lived it: imports, plan, engine, and the first step's extra
        ready_at, warmup_s = time.time(), time.perf_counter() - t_warm
        buffers: dict[str, int] = {}
        names = {b.name: b.component for b in buffer_plan(config, execution)}
        for name, nbytes in engine.buffer_bytes().items():
            component = names.get(name, name)
            buffers[component] = buffers.get(component, 0) + nbytes
        phase, step = "the memory step", 2
        transient, how, memory = _memory_step(engine, device, _synthetic(config, gen), lr, live,
                                              counted_all=not execution.compile)
        times = []
        for k in range(steps):
            phase, step = "a timed step", 3 + k
            batch = _synthetic(config, gen)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            result = engine.train_step(batch, lr)
            float(result.loss)  # the step is done when its loss is on the host
            times.append(time.perf_counter() - t0)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _probe_error(f"--probe: out of memory during {phase} (step {step}) on {device}: {err}".strip(),
                           "probe.oom", expected="the config to fit the device", got=f"OOM at step {step}") from None
    except AprError:
        raise
    except Exception as err:  # a config the engine cannot run (the plan's findings say why)
        raise _probe_error(f"--probe: failed during {phase} (step {step}) on {device}: {type(err).__name__}: "
                           f"{err}", "probe.failed", expected="a config the engine can build and step",
                           got=type(err).__name__) from None
    tokens = config.data.batch_size * config.data.seq_len * config.training.gradient_accumulation
    step_s = statistics.median(times)
    # compiling (block 0 at engine build, the first step's graphs) is its own term, not start-up
    compiled = compile_seconds(began, only_after=True)  # an earlier probe in this process compiled its own
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    startup = max(0.0, ready_at - STARTED_AT + max(0.0, warmup_s - step_s) - compiled["seconds"])
    if ready_at - STARTED_AT > STARTUP_MAX_S:  # a long-lived process (a notebook): not apply's start-up
        startup = None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    modelled_transient = sum(modelled.get(c, 0) for c in TRANSIENT)
    rows = []
    for component, nbytes in buffers.items():
        rows.append({"component": component, "modelled": modelled.get(component), "measured": nbytes})
    rows.append({"component": "transient", "parts": [c for c in TRANSIENT if modelled.get(c)],
                 "modelled": modelled_transient, "measured": int(transient)})
    return {
        "device": device.type, "device_name": device_name(device),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "apr": __version__,
                     "python": platform.python_version()},
        "execution": execution.to_dict(), "steps": steps, "step_seconds": step_s, "step_seconds_all": times,
        "tokens_per_step": tokens, "tokens_per_s": tokens / step_s, "rows": rows, "transient_bytes": int(transient),
        "transient_how": how, "modelled_transient_bytes": modelled_transient, "peak_rss_bytes": int(rss),
        "device_memory": memory,
        "seconds": time.perf_counter() - t_start, "startup_seconds": startup,
        "threads": thread_choice["threads"], "thread_choice": thread_choice, "load": thread_choice["load"],
        **({"compile_seconds": compiled["seconds"], "compile_cache": compiled["cache"], "compile_cache_dir": cache_dir}
           if compiled["seconds"] > 0 else {}),
    }
