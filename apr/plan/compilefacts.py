"""``training.execution.compile: auto`` at plan time (docs/design.md, "Compile when it pays"): the
device, the run's steps and their measured (probe, finished runs) or estimated time against what
compiling costs; apr/steps/execution.py ``decide_compile`` makes the decision, this module gathers
its inputs from the facts and writes the outcome into them (the policy the engine receives, its
line, and the memory rows when compiling drops the compute copy). Torch-free."""

from __future__ import annotations

from apr import hardware
from apr.config.schema import AprConfig
from apr.fmt import fmt_giga, fmt_percent, fmt_seconds
from apr.memory.table import memory_table
from apr.plan import gpus
from apr.plan.gpus import Target
from apr.steps import execution as policy
from apr.steps.execution import CompileDecision, Execution
from apr.track.names import compile_cache_dir, compile_cache_warm


def compile_device(config: AprConfig, target: Target | None) -> str:
    """The device the blocks would be compiled for: ``training.device``, or for ``auto`` what apply
    would pick here (CUDA when the plan targets a GPU or this machine has one, else the CPU)."""
    device = str(config.training.device)
    if device != "auto":
        return device
    return "cuda" if (target is not None and target.gpu is not None) or gpus.cuda_device_present() else "cpu"


# What a CPU thread is assumed to sustain on a step's matmuls (fp32) when no probe measured this
# shape: on the dev box's AMD EPYC one thread ran bench_engine's 10.5M step (129 GFLOP executed) in
# ~3 s, ~43 GFLOP/s. Assuming a little faster is the cautious side: a shorter step saves less.
CPU_FLOPS_PER_THREAD = 50e9


def _step_flops(facts: dict) -> float:
    """FLOPs one process executes per step: its tokens x the model's FLOPs per token x the
    execution's recompute (``cost_f / 3``)."""
    world = max(1, int(facts.get("world_size", 1)))
    return (facts["schedule"]["tokens_per_step"] / world * facts["model"]["flops_per_token"]
            * facts["execution"]["cost_f"] / 3.0)


def cpu_step_seconds(facts: dict) -> tuple[float, str]:
    """A step's time at ``CPU_FLOPS_PER_THREAD`` x the run's intra-op threads (apr/threads.py), at
    most the usable cores: threads beyond them add no FLOPs."""
    choice = facts.get("threads") or {}
    threads = max(1, int(choice.get("threads") or 1))
    threads = min(threads, max(1, int(choice.get("cores") or threads)))
    rate = CPU_FLOPS_PER_THREAD * threads
    return _step_flops(facts) / rate, (f"estimated at an assumed {fmt_giga(CPU_FLOPS_PER_THREAD)}FLOP/s x "
                                        f"{threads} thread{'s' if threads != 1 else ''}; --probe measures it")


def gpu_step_seconds(config: AprConfig, facts: dict, target: Target | None) -> tuple[float | None, str]:
    """A step's time at the assumed MFU of the target GPU, else of this machine's GPU when the
    catalogue knows it (apply on a GPU box without --gpu); None when neither is known."""
    gpu, where = (target.gpu, "the target") if target is not None and target.gpu is not None else (None, "")
    if gpu is None and (name := gpus.local_gpu_name()) is not None:
        gpu, where = hardware.from_device_name(name), "this machine's GPU"
    peak = gpu.peak_flops(str(config.training.mixed_precision)) if gpu is not None else None
    if peak is None:
        return None, ""
    return _step_flops(facts) / (peak * gpu.mfu), f"estimated at {where}'s assumed MFU, {gpu.name}"


def decide(config: AprConfig, facts: dict, target: Target | None, total_steps: int | None,
           eager: dict | None, compiled: dict | None) -> CompileDecision:
    """``eager``/``compiled``: calibration summaries of this shape with the blocks eager / compiled
    (apr/track/calibration.py), None when no probe or run measured them."""
    device = compile_device(config, target)
    step_s, basis = None, ""
    if eager is not None and eager.get("step_seconds"):
        step_s, basis = eager["step_seconds"], f"measured: {eager['what']}"
    elif device == "cuda":
        step_s, basis = gpu_step_seconds(config, facts, target)
    elif device == "cpu":
        step_s, basis = cpu_step_seconds(facts)
    measured = None
    if eager is not None and compiled is not None and eager.get("step_seconds") and compiled.get("step_seconds"):
        measured = 1.0 - compiled["step_seconds"] / eager["step_seconds"]
    problem = policy.compile_problem(device)
    if problem is not None and device == "cuda":  # planned elsewhere: apply decides again on the GPU box
        problem += " here; apply decides again on the machine it runs on"
    warm, _why = cache_state(compiled)
    if (measured is not None and measured <= 0 and problem is None and total_steps and step_s
            and config.training.execution.compile == "auto"):
        # compiled steps measured no faster: no saving to weigh against compiling (not "x -92% saved")
        return CompileDecision(False, "auto", f"compiled steps measured {fmt_percent(-measured)} slower than eager "
                               f"ones ({fmt_seconds(compiled['step_seconds'])} against "
                               f"{fmt_seconds(eager['step_seconds'])} a step, measured by probes or runs of both)",
                               device=device, steps=total_steps, step_seconds=step_s, saving=measured,
                               saving_source="measured by probes of both", saved_seconds=0.0,
                               cache="warm" if warm else "cold")
    return policy.decide_compile(config, device=device, total_steps=total_steps, step_seconds=step_s,
                                 step_basis=basis, measured_saving=measured, cache_warm=warm, problem=problem)


def cache_state(compiled: dict | None) -> tuple[bool, str]:
    """Whether inductor's cache is warm for this shape, checked rather than assumed: the folder apply
    compiles into holds compiled graphs, and a compiled probe or run of this shape (``compiled``,
    its calibration summary) recorded filling that folder. Anything else is cold: an empty folder,
    one of another shape's graphs, a tmp cleaner's leftovers. Returns (warm, why)."""
    folder = compile_cache_dir()
    if not compile_cache_warm(folder):
        return False, f"{folder} holds no compiled graphs"
    dirs = ((compiled or {}).get("compile") or {}).get("dirs") or []
    if str(folder) not in dirs:
        return False, f"no compiled probe or run of this shape filled {folder}"
    return True, f"{folder} holds this shape's graphs"


def compile_term(device: str, compiled: dict | None) -> dict:
    """The time compiling adds to a compiled run, its own term of the estimate (never step time):
    what compiled probes and runs of this shape measured at this cache state, else the assumed
    cost of the device (apr/steps/execution.py ``COMPILE_COST_S``)."""
    warm, why = cache_state(compiled)
    cache = "warm" if warm else "cold"
    seconds = ((compiled or {}).get("compile") or {}).get(cache)
    source = "measured by compiled probes or runs of this shape" if seconds else "assumed for the device"
    if not seconds:
        seconds = policy.COMPILE_COST_S.get(device, policy.COMPILE_COST_S["cpu"])[cache]
    return {"seconds": seconds, "cache": cache, "cache_why": why, "source": source}


def record(sheet, config: AprConfig, ranked: AprConfig, decision: CompileDecision) -> None:
    """Write the decision into the facts: ``execution.compile`` (the decision and why), the policy
    the engine receives, and, where compiling changes the buffer plan (the compute copy), the
    memory rows of ``ranked`` (the config at the planned ranks)."""
    facts = sheet.facts
    ex = facts["execution"]
    ex["compile"] = {**decision.to_dict(), "cache_dir": str(compile_cache_dir())}
    if bool(ex["policy"]["compile"]) == decision.compile:
        return
    layers = config.model.architecture.num_hidden_layers
    execution: Execution = Execution.from_dict({**ex["policy"], "compile": decision.compile}, layers)
    ex["policy"] = execution.to_dict()
    ex["policy_line"] = policy.describe(config, execution)
    rows = memory_table(ranked, execution=execution)
    memory = facts["memory"]
    memory["total_bytes"] = sum(r.bytes for r in rows)
    memory["by_component"] = {r.component: r.bytes for r in rows}
    if memory.get("vram_bytes"):
        memory["usage_fraction"] = memory["total_bytes"] / memory["vram_bytes"]
    sheet.memory = rows
