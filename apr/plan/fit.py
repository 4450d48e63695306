"""`apr train plan --fit`: the layout that trains fastest within the memory budget (docs/plan.md, "--fit").

Torch-free. The search keeps the global batch (sequences per optimizer step: data.batch_size x
training.gradient_accumulation x training.world_size of the config) and every key but the layout:
micro-batch x gradient accumulation x activation policy (apr/steps/execution.py ``candidates``) x
sharding (on several ranks) x compile. Each candidate's memory is the plan's own table
(apr/memory/table.py ``memory_table``); it fits when its peak is within the target's memory less the
headroom contract C-MEM-002 asks for. Its time per token is the execution's forward-equivalents at
the device's assumed rate (the plan's time model), replaced by probe or run calibrations of that
shape where the store has them, and scaled by what those measured where it does not; compiling
saves the device's assumed share of a step and costs its compile time, counted at the margin
``compile: auto`` asks for. The fastest fitting candidate wins; ties go to the larger micro-batch
(fewer micro-batches a step), then the least sharding (the model counts no communication), then the
least memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from apr.checkpoint.manager import read_info, scan
from apr.config import load_config
from apr.config.auto import ACCUMULATION, BATCH, SHARDING
from apr.config.schema import AprConfig, Sharding
from apr.errors import AprError, ConfigError, Finding
from apr.fmt import format_bytes
from apr.fsutil import check_output_file, output_write_error, write_output
from apr.memory.table import memory_table
from apr.plan import compilefacts
from apr.plan.facts import calibration_facts
from apr.plan.gpus import Target
from apr.plan.memory import step_cost_f
from apr.steps import execution as policy
from apr.steps.execution import Execution

HEADROOM = 0.10  # the share of the memory C-MEM-002 keeps free (contracts/memory-v1.yaml)
SHARDING_ORDER = ("none", "shard_grad_op", "hybrid", "full")  # the least communication first
SHOWN = 8  # candidates the text output lists

# the keys a fit may change, in the order a fitted file lists them
LAYOUT_KEYS = ("data.batch_size", "training.gradient_accumulation", "training.execution.activations",
               "training.execution.gradients", "training.sharding", "training.execution.compile")


class FitError(AprError):
    """No layout can be fitted (exit 1): no budget, a global batch the ranks cannot split, nothing fits."""


@dataclass(frozen=True)
class Candidate:
    batch_size: int
    accumulation: int
    sharding: str
    execution: Execution
    peak_bytes: int
    fits: bool
    cost_f: float
    seconds_per_token: float | None  # the run's average over the global batch (compiling included); None: unknown
    score: float  # what the search minimises: seconds per token (compiling at its margin), else cost_f
    basis: str  # model | measured | model scaled to measurements | relative (forward-equivalents only)

    @property
    def tokens_per_s(self) -> float | None:
        return 1.0 / self.seconds_per_token if self.seconds_per_token else None

    @property
    def keys(self) -> dict:
        return {"data.batch_size": self.batch_size, "training.gradient_accumulation": self.accumulation,
                "training.execution.activations": self.execution.activations,
                "training.execution.gradients": self.execution.gradients,
                "training.sharding": self.sharding, "training.execution.compile": self.execution.compile}

    def rank_key(self) -> tuple:
        return (self.score, -self.batch_size, SHARDING_ORDER.index(self.sharding), self.peak_bytes)

    def to_dict(self) -> dict:
        return {"keys": self.keys, "peak_bytes": self.peak_bytes, "tokens_per_s": self.tokens_per_s,
                "fits": self.fits, "cost_f": self.cost_f, "basis": self.basis}


@dataclass
class Fit:
    config_path: str
    global_batch: int  # sequences per optimizer step, kept
    seq_len: int
    world_size: int
    nodes: int
    vram_bytes: int
    budget_bytes: int
    target: str
    chosen: Candidate
    changed: dict  # the keys the fit changes, with their values (a fitted file's overrides)
    candidates: list[Candidate]  # the best policy of each layout, fastest first (fitting ones first)
    searched: int  # (layout, policy) pairs whose memory was counted
    why: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def planned_as_is(self, plan) -> bool:
        """The plan already resolved the chosen layout (its ``auto`` policy picked the same): planning
        the changed keys again would print the same plan."""
        c, config = self.chosen, plan.config
        return ((c.batch_size, c.accumulation) == (config.data.batch_size, config.training.gradient_accumulation)
                and (plan.world_size == 1 or c.sharding == str(config.training.sharding))
                and c.execution.to_dict() == plan.execution["policy"])

    def to_dict(self) -> dict:
        return {"chosen": dict(self.changed), "layout": self.chosen.keys, "why": self.why,
                "global_batch_sequences": self.global_batch, "tokens_per_step": self.global_batch * self.seq_len,
                "world_size": self.world_size, "nodes": self.nodes, "vram_bytes": self.vram_bytes,
                "budget_bytes": self.budget_bytes, "headroom": HEADROOM, "target": self.target,
                "peak_bytes": self.chosen.peak_bytes, "tokens_per_s": self.chosen.tokens_per_s,
                "candidates": [c.to_dict() for c in self.candidates], "searched": self.searched,
                "notes": list(self.notes), "seconds": self.seconds}


def _error(message: str, code: str, path: str, expected: str, got: str, file: str | None = None) -> FitError:
    return FitError(message, [Finding("error", code, message, path=path, file=file, expected=expected, got=got)])


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def global_batch(config: AprConfig) -> int:
    """Sequences per optimizer step as the config states it (at its own training.world_size)."""
    return config.data.batch_size * config.training.gradient_accumulation * config.training.world_size


def split_check(config: AprConfig, world_size: int, file: str | None = None) -> int:
    """The sequences each rank takes per step; a global batch ``world_size`` ranks cannot split is
    refused, naming the nearest global batches that they can and the rank counts that split this one."""
    total = global_batch(config)
    if total % world_size == 0:
        return total // world_size
    below, above = total // world_size * world_size, (total // world_size + 1) * world_size
    nearest = " or ".join(str(n) for n in (below, above) if n > 0)
    ranks = ", ".join(str(d) for d in divisors(total) if d <= max(world_size * 2, 8))
    tr = config.training
    message = (f"the global batch of {total} sequences (data.batch_size {config.data.batch_size} x "
               f"training.gradient_accumulation {tr.gradient_accumulation} x training.world_size {tr.world_size}) "
               f"cannot be split over {world_size} ranks: no micro-batch x accumulation gives each rank the "
               f"same share; the nearest global batches {world_size} ranks divide are {nearest} sequences "
               f"(or plan on {ranks} ranks)")
    raise _error(message, "plan.fit_global_batch", "--world-size",
                 f"a global batch divisible by {world_size}, e.g. {nearest}", str(total), file)


def _layout_config(config: AprConfig, *, batch_size: int, accumulation: int, sharding: str, world_size: int,
                   nodes: int, compile: bool) -> AprConfig:
    """The config at one layout, every activation and gradient choice left free."""
    tr = config.training
    execution = tr.execution.model_copy(update={"activations": "auto", "gradients": "auto", "compile": compile})
    training = tr.model_copy(update={"gradient_accumulation": accumulation, "sharding": Sharding(sharding),
                                     "world_size": world_size, "nodes": nodes, "execution": execution})
    return config.model_copy(update={"data": config.data.model_copy(update={"batch_size": batch_size}),
                                     "training": training})


def _batches(config: AprConfig, per_rank: int, free: tuple[str, ...] | None) -> list[int]:
    """The micro-batches searched: every divisor of a rank's share, or the one a stated count leaves."""
    if free is None or (BATCH in free and ACCUMULATION in free):
        return divisors(per_rank)
    stated = config.training.gradient_accumulation if BATCH in free else config.data.batch_size
    if per_rank % stated:
        return []
    return [per_rank // stated] if BATCH in free else [stated]


def _device_flops(plan, device: str) -> tuple[float | None, str]:
    """FLOP/s one process sustains on the model's matmuls: the target GPU's peak x its assumed MFU, or
    the CPU's assumed rate per thread x the run's threads (apr/plan/compilefacts.py)."""
    config, target = plan.config, plan.target
    if device == "cuda":
        gpu = target.gpu if target is not None else None
        peak = gpu.peak_flops(str(config.training.mixed_precision)) if gpu is not None else None
        if peak is None:
            return None, "no GPU from the catalogue (--gpu NAME): the step time is unknown"
        return peak * gpu.mfu, f"{gpu.label} at an assumed {gpu.mfu:.0%} MFU"
    if device == "cpu":
        choice = plan.facts.get("threads") or {}
        threads = max(1, int(choice.get("threads") or 1))
        threads = min(threads, max(1, int(choice.get("cores") or threads)))
        return compilefacts.CPU_FLOPS_PER_THREAD * threads, f"the CPU at an assumed {threads} thread(s)"
    return None, f"no time model for device {device}"


def _run_tokens(plan) -> int | None:
    steps = plan.facts.get("steps") or {}
    if steps.get("total_tokens"):
        return int(steps["total_tokens"])
    return (plan.time_estimate or {}).get("tokens")


def fit_plan(plan, *, headroom: float = HEADROOM, free: tuple[str, ...] | None = None) -> Fit:
    """Search the layouts of ``plan``'s config at its ranks and target; see the module's docstring.
    ``free``: the ``auto`` keys of the config (apr/config/auto.py), the only layout keys searched then
    (with the plan's own activation and gradient choice, and compile as stated); None: all of them."""
    t0 = time.perf_counter()
    config, target, file = plan.config, plan.target, str(plan.config_path)
    if target is None or not target.vram_bytes:
        raise _error("--fit needs a memory budget: name the GPU (--gpu NAME) or its memory (--vram SIZE), "
                     "or set training.gpu / training.vram", "plan.fit_no_budget", "--gpu", "--gpu NAME or --vram SIZE",
                     "no target", file)
    world, nodes = plan.world_size, plan.nodes
    per_rank = split_check(config, world, file)
    budget = int(target.vram_bytes * (1.0 - headroom))
    tr = config.training
    notes: list[str] = []

    if world == 1 or (free is not None and SHARDING not in free):
        shardings = [str(tr.sharding)]
    elif str(config.optimizer.name) == "adafactor":
        shardings = ["none"]
        notes.append("sharding not searched: adafactor does not run under training.sharding")
    else:
        hybrid = ["hybrid"] if nodes > 1 and world % nodes == 0 else []
        shardings = ["none", "shard_grad_op", *hybrid, "full"]
    device = compilefacts.compile_device(config, target)
    flops, rate_basis = _device_flops(plan, device)
    tokens = _run_tokens(plan)
    problem = policy.compile_problem(device)
    stated = policy.compile_stated(config)
    if free is not None:
        compiles = [stated]  # compile: auto is the plan's own decision (apr/plan/compilefacts.py)
    elif problem is not None:
        compiles = [stated]
        notes.append(f"compile not searched ({problem} here): training.execution.compile stays as stated")
    elif flops is None or not tokens:
        compiles = [stated]
        notes.append("compile not searched: " + ("the run's length is unknown" if not tokens else rate_basis))
    else:
        compiles = [False, True]
    flops_per_token = plan.facts["model"]["flops_per_token"]
    # rows beside the layout's table (a teacher, an orchestrator's copies), carried over as the plan has them
    ranked = _layout_config(config, batch_size=config.data.batch_size, accumulation=tr.gradient_accumulation,
                            sharding=str(tr.sharding), world_size=world, nodes=nodes, compile=stated)
    planned = Execution.from_dict(plan.execution["policy"], config.model.architecture.num_hidden_layers)
    extra = max(0, sum(r.bytes for r in plan.memory) - sum(r.bytes for r in memory_table(ranked, execution=planned)))

    def model_seconds(cost_f: float) -> float | None:  # seconds per global token, eager
        return flops_per_token * cost_f / 3.0 / (flops * world) if flops else None

    layouts: list[tuple[AprConfig, list[tuple[Execution, int, float]]]] = []
    searched = 0
    for batch in _batches(config, per_rank, free):
        for sharding in shardings:
            for compile in compiles:
                cfg = _layout_config(config, batch_size=batch, accumulation=per_rank // batch, sharding=sharding,
                                     world_size=world, nodes=nodes, compile=compile)
                options = []
                for e in policy.candidates(cfg):  # every source honours the policy
                    searched += 1
                    peak = sum(r.bytes for r in memory_table(cfg, execution=e)) + extra
                    options.append((e, peak, step_cost_f(cfg, e)))
                layouts.append((cfg, options))

    if not layouts:  # a stated count that a rank's share does not divide
        stated = ACCUMULATION if BATCH in (free or ()) else BATCH
        value = tr.gradient_accumulation if stated == ACCUMULATION else config.data.batch_size
        raise _error(f"{stated} {value} does not divide the {per_rank} sequences each of {world} rank(s) takes: "
                     f"set it to auto too, or plan on fewer ranks", "plan.fit_global_batch", stated,
                     f"a divisor of {per_rank}", str(value), file)
    # each layout's fastest fitting policy (the plan's own rule: fewest forward-equivalents, then memory),
    # else its leanest
    picks = []
    for cfg, options in layouts:
        fitting = sorted((o for o in options if o[1] <= budget), key=lambda o: (o[2], o[1]))
        e, peak, cost = fitting[0] if fitting else min(options, key=lambda o: (o[1], o[2]))
        picks.append((cfg, e, peak, cost, bool(fitting)))

    # calibrations: measured where a probe or run of the shape exists; the others scaled by what they measured
    measured: dict[int, float] = {}
    for i, (cfg, e, _peak, _cost, fits) in enumerate(picks):
        if not fits or not flops:  # without a model rate, measured and unmeasured ones are not comparable
            continue
        cal = calibration_facts(cfg, e.to_dict(), target, world_size=world, nodes=nodes)
        if cal and cal.get("tokens_per_s"):
            measured[i] = 1.0 / (cal["tokens_per_s"] * world)
    scale = 1.0
    if measured:
        ratios = [measured[i] / model_seconds(picks[i][3]) for i in measured if not picks[i][1].compile]
        scale = statistics.median(ratios) if ratios else 1.0
    if measured:
        notes.append(f"{len(measured)} candidate(s) measured by probes or runs of their shape"
                     + (f"; the model's estimates scaled by x{scale:.2f} to match" if scale != 1.0 else ""))

    candidates = []
    for i, (cfg, e, peak, cost, fits) in enumerate(picks):
        if i in measured:
            steady, basis = measured[i], "measured"
        elif flops:
            steady = model_seconds(cost) * scale
            basis = "model scaled to measurements" if scale != 1.0 else "model"
            if e.compile:
                steady *= 1.0 - policy.COMPILE_SAVES[device]
        else:
            steady, basis = None, "relative"
        if steady is not None and e.compile and tokens:
            compiling = compilefacts.compile_term(device, None)["seconds"]
            run_seconds = steady + compiling / tokens
            score = steady + policy.COMPILE_MARGIN * compiling / tokens
        else:
            run_seconds, score = steady, (steady if steady is not None else cost)
        candidates.append(Candidate(cfg.data.batch_size, cfg.training.gradient_accumulation,
                                    str(cfg.training.sharding), e, peak, fits, cost, run_seconds, score, basis))
    fitting = sorted((c for c in candidates if c.fits), key=Candidate.rank_key)
    if not fitting:
        raise _none_fits(config, candidates, budget, target, world, file, headroom)
    others = sorted((c for c in candidates if not c.fits), key=lambda c: (c.peak_bytes, c.rank_key()))
    chosen = fitting[0]
    fit = Fit(config_path=file, global_batch=global_batch(config), seq_len=config.data.seq_len, world_size=world,
              nodes=nodes, vram_bytes=target.vram_bytes, budget_bytes=budget,
              target=target.gpu.label if target.gpu else target.source, chosen=chosen,
              changed=changed_keys(plan, chosen, compiles), candidates=[*fitting, *others], searched=searched,
              why=why_line(fitting, candidates, budget), notes=notes)
    if flops is None:
        notes.append(f"tokens/s unknown ({rate_basis}): candidates ranked by forward-equivalents per step")
    else:
        notes.append(f"time model: {rate_basis}")
    fit.seconds = time.perf_counter() - t0
    return fit


def changed_keys(plan, chosen: Candidate, compiles: list[bool]) -> dict:
    """The layout keys whose chosen value differs from the config's, and the ranks when --world-size /
    --nodes differ from training.world_size / training.nodes."""
    config = plan.config
    tr = config.training
    stated = {"data.batch_size": config.data.batch_size, "training.gradient_accumulation": tr.gradient_accumulation,
              "training.execution.activations": str(tr.execution.activations),
              "training.execution.gradients": str(tr.execution.gradients), "training.sharding": str(tr.sharding),
              "training.execution.compile": tr.execution.compile}
    out = {}
    autograd = policy.gradient_source(config) == "standard"
    for key, value in chosen.keys.items():
        if autograd and key == "training.execution.gradients":
            continue  # autograd keeps every gradient whatever the policy says
        if key == "training.execution.compile" and len(compiles) == 1:
            continue  # not searched: left as stated
        if key == "training.sharding" and plan.world_size == 1:
            continue
        if stated[key] != value or type(stated[key]) is not type(value):
            out[key] = value
    if plan.world_size != tr.world_size:
        out["training.world_size"] = plan.world_size
    if plan.nodes != tr.nodes:
        out["training.nodes"] = plan.nodes
    return out


def describe(c: Candidate) -> str:
    """One candidate in a few words: ``batch_size 4 x accumulation 2, keep (kept), sharding full, compiled``."""
    parts = [f"batch_size {c.batch_size} x accumulation {c.accumulation}",
             f"{c.execution.activations} ({c.execution.gradients} gradients)"]
    if c.sharding != "none":
        parts.append(f"sharding {c.sharding}")
    parts.append("compiled" if c.execution.compile else "eager")
    return ", ".join(parts)


def _rate(c: Candidate) -> str:
    return f"~{c.tokens_per_s:,.0f} tokens/s" if c.tokens_per_s else f"{policy.fmt_f(c.cost_f)} a micro-batch"


def why_line(fitting: list[Candidate], candidates: list[Candidate], budget: int) -> str:
    """Why the first of ``fitting`` won: against the runner-up, and against a faster one that does not fit."""
    best = fitting[0]
    out = (f"the fastest of {len(fitting)} fitting layout(s): {_rate(best)} "
           f"({policy.fmt_f(best.cost_f)} per micro-batch), peak {format_bytes(best.peak_bytes)} of "
           f"{format_bytes(budget)}")
    if len(fitting) > 1:
        nxt = fitting[1]
        if nxt.score > best.score:
            out += f"; {nxt.score / best.score - 1:.1%} faster than the next ({describe(nxt)})"
        else:
            tie = ("the larger micro-batch" if nxt.batch_size != best.batch_size else
                   "the least sharding" if nxt.sharding != best.sharding else "the least memory")
            out += f"; it ties with {describe(nxt)} on the estimate, and {tie} wins"
    faster = [c for c in candidates if not c.fits and c.score < best.score]
    if faster:
        f = min(faster, key=Candidate.rank_key)
        out += f"; {describe(f)} would be faster but needs {format_bytes(f.peak_bytes)}"
    return out


def _none_fits(config: AprConfig, candidates: list[Candidate], budget: int, target, world: int, file: str,
               headroom: float) -> FitError:
    smallest = min(candidates, key=lambda c: c.peak_bytes)
    where = "process" if str(target.source).startswith("this machine's RAM") else "GPU"
    advice = ["a larger GPU (--gpu) or more memory (--vram)", "a shorter data.seq_len", "a smaller model"]
    if world == 1:
        advice.insert(1, "more ranks with sharding (--world-size N, training.sharding full)")
    message = (f"no layout of the global batch fits: the smallest, {describe(smallest)}, needs "
               f"{format_bytes(smallest.peak_bytes)} per {where} against a budget of "
               f"{format_bytes(budget)} ({1 - headroom:.0%} of {format_bytes(target.vram_bytes)}, {target.source}); "
               f"change one of: {', '.join(advice)}")
    return _error(message, "plan.fit_none", "data.batch_size", f"at most {format_bytes(budget)}",
                  format_bytes(smallest.peak_bytes), file)


# ------------------------------------------------------------------------------------ auto keys


def auto_budget(target, device_budget: tuple[int, str] | None):
    """The fit's target: the plan's, else apply's device memory (``device_budget``: bytes, source)."""
    if (target is None or not target.vram_bytes) and device_budget is not None:
        return Target(name=None, gpu=None, vram_bytes=int(device_budget[0]), source=str(device_budget[1]))
    return target


def fit_auto(plan, autos: tuple[str, ...]) -> tuple[dict, dict]:
    """The values of the config's ``auto`` keys that train fastest within the plan's budget (the search of
    ``fit_plan`` over those keys only, at the plan's ranks), and the record the plan keeps of them
    (``facts.fitted``): ``keys`` (each auto key with its value; build_plan adds the ranks when the plan's
    differ from the config's),
    the kept global batch, the chosen layout's peak and tokens/s, the budget and why it won."""
    try:
        fit = fit_plan(plan, free=autos)
    except FitError as err:
        first = err.findings[0] if err.findings else None
        path = autos[0] if first is not None and first.path in ("--gpu", "--world-size") else None
        if path is None:
            raise
        message = f"{path}: auto: {err.message}"
        raise FitError(message, [dataclasses.replace(first, message=message, path=path)]) from None
    keys = {key: fit.chosen.keys[key] for key in autos}
    record = {"keys": keys, "auto": list(autos), "global_batch_sequences": fit.global_batch,
              "peak_bytes": fit.chosen.peak_bytes, "tokens_per_s": fit.chosen.tokens_per_s,
              "budget_bytes": fit.budget_bytes, "target": fit.target, "why": fit.why,
              "layouts": len(fit.candidates), "seconds": fit.seconds}
    return keys, record


def auto_line(record: dict) -> str:
    """``data.batch_size auto -> 8, training.gradient_accumulation auto -> 4 (global batch of 32 kept): why``."""
    chosen = ", ".join(f"{key} auto -> {json.dumps(record['keys'][key])}" for key in record["auto"])
    return f"{chosen} (global batch of {record['global_batch_sequences']} sequences kept): {record['why']}"


def fitted_settings(plan_doc: dict) -> dict:
    """The values a saved plan fitted for its config's ``auto`` keys, as settings: what apply runs."""
    return dict(((plan_doc.get("facts") or {}).get("fitted") or {}).get("keys") or {})


def resumed_settings(run_dir: Path, resume: str, autos: tuple[str, ...], world_size: int) -> dict:
    """What the checkpoint a resume continues ran for the config's ``auto`` keys: a resume never fits
    again. The accumulation only when it ran on ``world_size`` ranks (on another number, the one that
    keeps the global batch: apr/plan/elastic.py); {} when it cannot be read (the resume reports that)."""
    try:
        if resume == "latest":
            found = [e for e in scan(run_dir) if e.complete]
            if not found:
                return {}
            saved = read_info(found[0].json_path).config
        else:
            saved = read_info(resume).config
        values = {BATCH: int(saved["data"]["batch_size"]), SHARDING: str(saved["training"].get("sharding", "none"))}
        if int(saved["training"].get("world_size", 1)) == world_size:
            values[ACCUMULATION] = int(saved["training"].get("gradient_accumulation", 1))
    except (AprError, OSError, KeyError, TypeError, ValueError):
        return {}
    return {key: value for key, value in values.items() if key in autos}


# ------------------------------------------------------------------------------------ the fitted file


def fitted_yaml(fit: Fit, out: Path, settings: dict | None = None) -> str:
    """A config that ``extends:`` the original (named relative to ``out``'s folder) and overrides the
    command line's settings and the keys the fit changed, nothing else."""
    base = os.path.relpath(os.path.abspath(fit.config_path), os.path.abspath(out.parent))
    values = {**(settings or {}), **fit.changed}
    tree: dict = {}
    for key, value in values.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    def emit(node: dict, indent: int) -> list[str]:
        lines = []
        for k, v in node.items():
            if isinstance(v, dict):
                lines += [f"{' ' * indent}{k}:", *emit(v, indent + 2)]
            else:
                lines.append(f"{' ' * indent}{k}: {json.dumps(v)}")
        return lines

    def one_line(text: str) -> str:  # a comment cannot end early: no line break of a path reaches the YAML
        return " ".join(str(text).split())

    head = [f"# apr train plan {one_line(fit.config_path)} --fit: the fastest layout within "
            f"{format_bytes(fit.budget_bytes)} ({1 - HEADROOM:.0%} of {format_bytes(fit.vram_bytes)}, "
            f"{one_line(fit.target)}) on {fit.world_size} rank(s)",
            f"# keeps the global batch: {fit.global_batch} sequences per optimizer step",
            f"extends: {json.dumps(base)}"]
    return "\n".join([*head, *emit(tree, 0)]) + "\n"


def write_fitted(fit: Fit, out: Path, *, settings: dict | None = None, overwrite: bool = False) -> str:
    """Write the fitted config through the checked writer (never over a file without ``overwrite``),
    after checking that it loads (its ``extends`` may point only where the loader allows)."""
    check_output_file(out, inputs=[fit.config_path], overwrite=overwrite, option="-out")
    text = fitted_yaml(fit, out, settings)
    folder = out.parent if str(out.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fit-", suffix=".yaml", dir=folder)
    except OSError as err:
        raise output_write_error(out, "-out", err) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_config(Path(tmp))  # e.g. extends outside the repository: refused before anything is written
    except ConfigError as err:
        def named(text: str | None) -> str | None:
            return text.replace(tmp, str(out)) if text else text

        found = [dataclasses.replace(f, file=named(f.file), message=named(f.message)) for f in err.findings]
        raise FitError(f"-out {out} not written: {named(err.message)}", found) from None
    except OSError as err:
        raise output_write_error(out, "-out", err) from None
    finally:
        os.unlink(tmp)
    write_output(out, text, inputs=[fit.config_path], overwrite=overwrite, option="-out")
    return text
