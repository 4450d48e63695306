"""Training throughput of apr's engines against a plain PyTorch loop (docs/performance.md, "Training engine").

One model config, one run, the same random token batches and the same initial weights for every
approach:

  auto                     apr's block walk (apr/train/walk.py), ``training.execution`` auto resolved by the plan's
                           chooser (apr/plan/memory.py) against a roomy budget (--budget-gib):
                           every graph and every gradient kept, exact global clipping (3F)
  lean/selective+adagc     one gradient workspace, selective recompute, clip_mode adagc
  lean/selective+per_block one gradient workspace, selective recompute, clip_mode per_block
  lean/recompute+per_block one gradient workspace, full recompute, clip_mode per_block
  lean/recompute+global    one workspace, full recompute, exact global clipping (norm-only pre-pass)
  standard                 apr on autograd (full backward, clipping, torch.optim.AdamW)
  baseline                 the plain loop written here: apr's model object used directly, full
                           [batch, seq, vocab] logits + F.cross_entropy, loss.backward(),
                           clip_grad_norm_, torch.optim.AdamW (fused when available, else foreach)

Precision: fp32 on the CPU, bf16 autocast on CUDA (fp32 master weights everywhere), or --precision.
Under bf16, --only also takes auto-nocopy and lean/recompute+per_block-nocopy: the same engines
without the compute copy (autocast re-casting the fp32 masters in every forward). Warmup steps
are excluded; tokens/s = batch x seq / median step time (time.perf_counter, CUDA synchronized).
The losses of every step are compared with the baseline's ("max |dloss|"): approaches that clip
exactly like it (auto, standard) must agree to 1e-6.

Memory: "grad MiB" is the peak of live ``.grad`` storage (distinct storages of the parameters'
``.grad``), sampled whenever a group's gradient is complete (the engines' probe) or after
``loss.backward()`` (baseline). On the CPU "peak RSS MiB" is the peak resident set of a fresh
process that builds only that approach and runs the warmup steps (``ru_maxrss``; the same torch
import and data in every child, so differences are the approach's weights, optimizer state,
gradients and activations); on CUDA "peak MiB" is ``torch.cuda.max_memory_allocated`` over the
timed steps with only that approach alive (approaches then run one after the other). On the CPU
the timed steps run round-robin, one step of each approach per round (A B C A B C ...), so drift on
a shared machine hits all of them alike (``--sequential`` runs them one after another).

    .venv/bin/python benchmarks/bench_engine.py [--device cpu|cuda] [--hidden 256] [--layers 6]
        [--heads 4] [--kv-heads 4] [--intermediate 1024] [--vocab 8192] [--seq 256] [--batch 8]
        [--loss-chunk 256] [--warmup 2] [--steps 10] [--threads N] [--only NAME,...] [--sequential]
        [--no-rss] [--budget-gib 64] [--json]

--only also takes auto+compile, lean/selective+adagc+compile and lean/recompute+per_block+compile
(training.execution.compile: true); their compile time is in "build + warmup" below the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from apr.steps.resolved import resolve as plan_of  # noqa: E402

# name -> (engine, clip_mode, training.execution); execution None: auto, resolved by the plan's chooser
SETTINGS = {
    "auto": ("interleaved", "global", None),
    "lean/selective+adagc": ("interleaved", "adagc", ("selective", "workspace")),
    "lean/selective+per_block": ("interleaved", "per_block", ("selective", "workspace")),
    "lean/recompute+per_block": ("interleaved", "per_block", ("recompute", "workspace")),
    "lean/recompute+global": ("interleaved", "global", ("recompute", "workspace")),
    # exact global clipping with one gradient workspace (issue 40 item 4): the norm pre-pass walk
    # backpropagates the kept graphs again (5F) or recomputes selective blocks in full (6.25F)
    "lean/keep+global": ("interleaved", "global", ("keep", "workspace")),
    "lean/selective+global": ("interleaved", "global", ("selective", "workspace")),
    "standard": ("standard", "global", None),
}
# training.execution.compile: true (torch.compile per block); run with --only, they compile for minutes
COMPILED = {"auto+compile": "auto", "lean/selective+adagc+compile": "lean/selective+adagc",
            "lean/recompute+per_block+compile": "lean/recompute+per_block"}
# bf16/fp16 only (--precision): the interleaved engine without its compute copy, i.e. autocast
# re-casting the fp32 masters in every forward (docs/design.md, "The engines")
NO_COPY = {"auto-nocopy": "auto", "lean/recompute+per_block-nocopy": "lean/recompute+per_block"}
DEFAULT = (*SETTINGS, "baseline")
APPROACHES = (*SETTINGS, *COMPILED, *NO_COPY, "baseline", "baseline+compile")
LR = 3e-4
SEED = 1234


def make_config(args, *, engine: str, clip_mode: str, execution: tuple[str, str] | None = None,
                compile: bool = False):
    from apr.config.schema import AprConfig

    cuda = args.device == "cuda"
    activations, gradients = execution or ("auto", "auto")
    return AprConfig.model_validate({
        "model": {"architecture": {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "intermediate_size": args.intermediate,
            "vocab_size": args.vocab, "max_position_embeddings": args.seq, "tie_word_embeddings": args.tied,
        }},
        "data": {"train": "unused/", "batch_size": args.batch, "seq_len": args.seq},
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "training": {
            "engine": engine, "clip_mode": clip_mode, "grad_clip": 1.0,
            "mixed_precision": args.precision or ("bf16" if cuda else "fp32"), "device": args.device,
            "kernels": args.kernels if cuda else "torch", "loss_chunk_size": args.loss_chunk, "seed": SEED,
            "execution": {"activations": activations, "gradients": gradients, "compile": compile},
        },
    })


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def live_grad_bytes(params) -> int:
    storages: dict[int, int] = {}
    for p in params:
        if p.grad is not None:
            st = p.grad.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@dataclass
class Approach:
    name: str
    note: str = ""
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds per step (all threads)
    warm_s: float = 0.0  # build + warmup steps (torch.compile happens here)
    losses: list = field(default_factory=list)  # every step's loss (device tensors until the end)
    cost_f: float = 3.0
    grad_bytes: int = 0
    peak_bytes: int | None = None
    profile: str | None = None  # --profile: the profiler tables
    last_loss: float | None = None
    step_fn: object = None  # (batch, probe: bool) -> loss tensor
    free_fn: object = None


def build_apr(args, device: torch.device, name: str) -> Approach:
    from apr.plan.memory import choose_execution
    from apr.steps import execution as policy
    from apr.train.build import build_engine

    engine_kind, clip_mode, execution = SETTINGS[COMPILED.get(name, NO_COPY.get(name, name))]
    config = make_config(args, engine=engine_kind, clip_mode=clip_mode, execution=execution,
                         compile=name in COMPILED)
    chosen = choose_execution(config, int(args.budget_gib * 2**30), "--budget-gib").execution
    if name in NO_COPY:
        from unittest import mock

        from apr.model import spec

        with mock.patch.object(spec, "uses_compute_copy", lambda *a, **k: False):
            engine = build_engine(plan_of(config, execution=chosen), device)
    else:
        engine = build_engine(plan_of(config, execution=chosen), device)
    params = list(engine.model.parameters())
    ap = Approach(name, note=f"kernels {engine.backend.name}; {policy.describe(config, chosen)}; "
                  f"{engine.strategy.describe()}", cost_f=policy.step_cost_f(config, chosen))

    def probe(_group: str) -> None:
        ap.grad_bytes = max(ap.grad_bytes, live_grad_bytes(params))

    def step(batch: torch.Tensor, measure: bool) -> torch.Tensor:
        engine.grad_probe = probe if measure else None
        return engine.train_step([batch], LR).loss

    def free() -> None:
        nonlocal engine, params
        del engine, params

    ap.step_fn, ap.free_fn = step, free
    return ap


def build_baseline(args, device: torch.device, compiled: bool = False) -> Approach:
    """The nanoGPT-style loop: model(ids) -> full logits, F.cross_entropy, backward, clip, AdamW
    (``compiled``: the model under ``torch.compile``, as nanoGPT's ``compile=True``)."""
    from apr.model import spec
    from apr.model.llama import build_model

    config = make_config(args, engine="standard", clip_mode="global")
    arch = config.model.architecture
    model = build_model(arch, SEED, device="cpu").to(device)  # the same initial weights as the engines
    named = dict(model.named_parameters())
    decay = {s.name for s in spec.param_specs(arch) if s.decay}  # the same decay rule as apr
    groups = [{"params": [p for n, p in named.items() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0}]
    kw = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8)
    try:  # fused where torch has it for this device (CUDA; the CPU since torch 2.4), else foreach
        opt, how = torch.optim.AdamW(groups, fused=True, **kw), "fused"
    except (RuntimeError, TypeError):
        opt, how = torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
    params = list(named.values())
    low = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    cast = (torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[low])
            if low != "fp32" else torch.autocast(device.type, enabled=False))
    ap = Approach("baseline+compile" if compiled else "baseline",
                  note=f"full logits + F.cross_entropy, clip_grad_norm_, torch AdamW ({how})"
                       f"{'; torch.compile(model)' if compiled else ''}")
    forward = torch.compile(model) if compiled else model

    def step(batch: torch.Tensor, measure: bool) -> torch.Tensor:
        batch = batch.to(device, non_blocking=True)
        ids, targets = batch[:, :-1], batch[:, 1:]
        with cast:
            logits = forward(ids)  # [batch, seq, vocab] float32
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if measure:
            ap.grad_bytes = max(ap.grad_bytes, live_grad_bytes(params))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def free() -> None:
        nonlocal model, opt, params, named, forward
        del model, opt, params, named, forward

    ap.step_fn, ap.free_fn = step, free
    return ap


def build(args, device: torch.device, name: str) -> Approach:
    if name.startswith("baseline"):
        return build_baseline(args, device, compiled=name == "baseline+compile")
    return build_apr(args, device, name)


def timed_step(ap: Approach, batch: torch.Tensor, device: torch.device) -> None:
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = ap.step_fn(batch, False)
    sync(device)
    ap.times.append(time.perf_counter() - t0)
    ap.cpu_times.append(time.process_time() - c0)
    ap.losses.append(loss)


def warm(ap: Approach, batches: list[torch.Tensor], device: torch.device) -> None:
    for i, batch in enumerate(batches):
        # the last warmup step measures live gradients
        ap.losses.append(ap.step_fn(batch, i == len(batches) - 1))
    sync(device)


def profile_steps(ap: Approach, batches: list[torch.Tensor], device: torch.device) -> str:
    """torch.profiler over a few steps: the top kernels by device time and the top host ops by
    self CPU time, to say where a step's time goes (docs/performance.md)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for batch in batches:
            ap.step_fn(batch, False)
        sync(device)
    ev = prof.key_averages()
    out = []
    if device.type == "cuda":
        out.append(ev.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    out.append(ev.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    return "\n".join(out)


def peak_rss_mib(args, name: str) -> float:
    """Peak resident set of a fresh process that builds ``name`` and runs the warmup steps."""
    import subprocess

    cmd = [sys.executable, __file__, "--rss-child", name, "--warmup", str(args.warmup)]
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch", "loss_chunk",
                "threads", "budget_gib", "precision"):
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    if args.tied:
        cmd.append("--tied")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def rss_child(args) -> None:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (large) parent through fork + exec
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.warmup)]
    ap = build(args, device, args.rss_child)
    warm(ap, data, device)
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) / 1024)  # kB


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def run(args) -> dict:
    device = torch.device(args.device)
    load_before = loadavg()
    gen = torch.Generator().manual_seed(0)
    n = args.warmup + args.steps
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(n)]
    if device.type == "cuda":
        data = [b.to(device) for b in data]
    warm_data, timed_data = data[: args.warmup], data[args.warmup:]
    names = [a for a in APPROACHES if (a in args.only if args.only else a in DEFAULT)]
    approaches: list[Approach] = []
    cuda = device.type == "cuda"
    if cuda or args.sequential:  # one at a time: on CUDA the allocator's peak is then that approach's
        for name in names:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            ap = build(args, device, name)
            warm(ap, warm_data, device)
            ap.warm_s = time.perf_counter() - t0
            for batch in timed_data:
                timed_step(ap, batch, device)
            if cuda:
                ap.peak_bytes = torch.cuda.max_memory_allocated(device)
            if args.profile:
                ap.profile = profile_steps(ap, timed_data[:3], device)
            ap.losses = [float(x) for x in ap.losses]
            ap.free_fn()
            ap.step_fn = ap.free_fn = None
            approaches.append(ap)
            print(f"  {name}: done", file=sys.stderr, flush=True)
    else:  # round-robin: every approach sees the same machine conditions
        for name in names:
            t0 = time.perf_counter()
            ap = build(args, device, name)
            warm(ap, warm_data, device)
            ap.warm_s = time.perf_counter() - t0
            approaches.append(ap)
            print(f"  {name}: built and warmed", file=sys.stderr, flush=True)
        for i, batch in enumerate(timed_data):
            for ap in approaches:
                timed_step(ap, batch, device)
            print(f"  round {i + 1}/{len(timed_data)}", file=sys.stderr, flush=True)
        for ap in approaches:
            ap.losses = [float(x) for x in ap.losses]
        if not args.no_rss:
            for ap in approaches:
                ap.peak_bytes = int(peak_rss_mib(args, ap.name) * 2**20)
                print(f"  {ap.name}: peak RSS measured", file=sys.stderr, flush=True)

    from apr.model.spec import param_count

    arch = make_config(args, engine="standard", clip_mode="global").model.architecture
    tokens = args.batch * args.seq
    rows = []
    ref = next((ap.losses for ap in approaches if ap.name == "baseline"), None)
    std = next((ap.losses for ap in approaches if ap.name == "standard"), None)

    def max_rel_diff(losses, other):
        if other is None:
            return None
        return max(abs(a - b) / abs(b) for a, b in zip(losses, other, strict=True))
    base_times = next((ap.times for ap in approaches if ap.name == "baseline"), None)
    for ap in approaches:
        med = statistics.median(ap.times)
        # the same round's baseline step over this step: robust to load that changes between rounds
        paired = None if base_times is None else statistics.median(
            b / t for b, t in zip(base_times, ap.times, strict=True))
        rows.append({
            "approach": ap.name, "step_ms_median": med * 1e3, "step_ms_min": min(ap.times) * 1e3,
            "step_ms_max": max(ap.times) * 1e3, "step_ms_all": [round(t * 1e3, 1) for t in ap.times],
            "tokens_per_s": tokens / med,
            "tokens_per_s_best": tokens / min(ap.times), "paired_ratio": paired, "warm_s": ap.warm_s,
            "cpu_ms_median": statistics.median(ap.cpu_times) * 1e3,
            "grad_mib": ap.grad_bytes / 2**20,
            "peak_mib": None if ap.peak_bytes is None else ap.peak_bytes / 2**20, "cost_F": ap.cost_f,
            "last_loss": ap.losses[-1], "losses": ap.losses, "note": ap.note, "profile": ap.profile,
            "max_rel_loss_diff_base": max_rel_diff(ap.losses, ref),
            "max_rel_loss_diff_std": max_rel_diff(ap.losses, std),
        })
    from apr.model.spec import flops_per_token

    flops = flops_per_token(arch, args.seq)  # forward + backward, the plan's figure (docs/plan.md)
    peak_tflops = args.peak_tflops
    for r in rows:
        r["mfu"] = None if not peak_tflops else r["tokens_per_s"] * flops / (peak_tflops * 1e12)
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"{cpu_name()}, {torch.get_num_threads()} torch threads"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine, "python": platform.python_version(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": loadavg(),
        "device": args.device, "precision": _precision_label(args, device),
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "vocab": args.vocab, "tied": args.tied,
                  "params": param_count(arch)},
        "batch": args.batch, "seq": args.seq, "loss_chunk": args.loss_chunk, "tokens_per_step": tokens,
        "warmup": args.warmup, "steps": args.steps, "results": rows,
        "full_logits_mib": tokens * args.vocab * 4 / 2**20,
        "chunk_logits_mib": args.batch * min(args.loss_chunk, args.seq) * args.vocab * 4 / 2**20,
        "flops_per_token": flops, "peak_tflops": peak_tflops,
    }


def _precision_label(args, device: torch.device) -> str:
    low = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    return "fp32" if low == "fp32" else f"{low} autocast"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(res: dict) -> str:
    m = res["model"]
    out = [
        f"bench_engine  {res['date']}  {res['machine']}  python {res['python']}  torch {res['torch']}",
        f"{res['cpu_count']} CPUs; load average (1/5/15 min) before {res['loadavg_before']}, "
        f"after {res['loadavg_after']}",
        f"model {m['params'] / 1e6:.2f}M params (hidden {m['hidden']}, {m['layers']} layers, heads "
        f"{m['heads']}/{m['kv_heads']} kv, intermediate {m['intermediate']}, vocab {m['vocab']}"
        f"{', tied' if m['tied'] else ''}); batch {res['batch']} x seq {res['seq']} = {res['tokens_per_step']} "
        f"tokens/step; {res['precision']} on {res['device']}; loss chunk {res['loss_chunk']}; "
        f"{res['warmup']} warmup + {res['steps']} timed steps (median)",
        "",
    ]
    rows = {r["approach"]: r for r in res["results"]}
    base = rows.get("baseline")
    mem = "peak MiB" if res["device"] == "cuda" else "peak RSS MiB"
    head = (f"{'approach':<25} {'step ms':>8} {'tokens/s':>9} {'x base':>7} {'best tok/s':>10} {'x base':>7} "
            f"{'paired':>6} {'cpu ms':>7} {'x base':>6} {'cost':>6} {'grad MiB':>9} {'x base':>7} "
            f"{mem:>12} {'x base':>7} "
            f"{'dloss/base':>9} {'dloss/std':>9}")
    out += [head, "-" * len(head)]
    for r in res["results"]:
        def ratio(key, r=r):
            return f"{r[key] / base[key]:.2f}" if base and base.get(key) and r.get(key) is not None else "-"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        paired = "-" if r["paired_ratio"] is None else f"{r['paired_ratio']:.2f}"
        cpu_ratio = f"{base['cpu_ms_median'] / r['cpu_ms_median']:.2f}" if base else "-"
        diff, diff_std = ("-" if r[k] is None else f"{r[k]:.1e}"
                          for k in ("max_rel_loss_diff_base", "max_rel_loss_diff_std"))
        out.append(f"{r['approach']:<25} {r['step_ms_median']:>8.0f} {r['tokens_per_s']:>9,.0f} "
                   f"{ratio('tokens_per_s'):>7} {r['tokens_per_s_best']:>10,.0f} {ratio('tokens_per_s_best'):>7} "
                   f"{paired:>6} {r['cpu_ms_median']:>7.0f} {cpu_ratio:>6} "
                   f"{r['cost_F']:>5.2f}F {r['grad_mib']:>9.1f} {ratio('grad_mib'):>7} {peak:>12} "
                   f"{ratio('peak_mib'):>7} {diff:>9} {diff_std:>9}")
    out += ["", "step ms / tokens/s: median timed step; best: the fastest timed step (least disturbed on a shared",
            "machine). x base: ratio to the baseline (tokens/s: >1 is faster; memory: <1 is less). paired: the",
            "median over rounds of (baseline step time / this step time) in the same round (CPU round-robin:",
            "the steps compared ran seconds apart, so load that changes between rounds cancels). cpu ms: median",
            "process CPU time per step (all threads; on a loaded machine the least disturbed figure with",
            "--threads 1, where no thread spins waiting for another); its x base is baseline / this. cost: step",
            "cost in forward-equivalents F from apr/steps/execution.py. dloss/base, dloss/std: the largest relative",
            "difference of any step's loss (warmup included) from the baseline's / apr standard engine's (same",
            "data, same initial weights; clipping other than global changes the trajectory, so only the",
            "global-clipping approaches are expected to agree; the baseline's unchunked cross-entropy rounds",
            "differently from apr's chunked one, the standard engine's is the same code).",
            f"Logits: the baseline materialises [batch, seq, vocab] float32 = {res['full_logits_mib']:.1f} MiB "
            f"(plus its gradient); apr's chunks hold {res['chunk_logits_mib']:.1f} MiB.", ""]
    if res.get("peak_tflops"):
        out += [f"MFU ({res['flops_per_token'] / 1e9:.2f} GFLOP/token from apr/model/spec.py, peak "
                f"{res['peak_tflops']:.0f} TFLOP/s): " + ", ".join(f"{r['approach']} {r['mfu']:.1%}"
                                                             for r in res["results"]), ""]
    out += [f"{r['approach']}: {r['note']} (build + warmup {r['warm_s']:.1f} s)" for r in res["results"]]
    for r in res["results"]:
        if r.get("profile"):
            out += ["", f"== profile of {r['approach']} (3 timed steps)", r["profile"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                    help="training.mixed_precision (default fp32 on the CPU, bf16 on CUDA); bf16 adds the "
                         "-nocopy approaches to --only's choices")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tied", action="store_true", help="tie the embedding to the LM head")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--loss-chunk", type=int, default=256, help="apr's training.loss_chunk_size")
    ap.add_argument("--kernels", default="auto", help="apr's training.kernels on CUDA (the CPU always uses torch)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default on the CPU: apr's choice for the config, apr/threads.py)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help=f"comma-separated subset of {','.join(APPROACHES)}")
    ap.add_argument("--sequential", action="store_true",
                    help="on the CPU too, run the approaches one after another instead of round-robin")
    ap.add_argument("--no-rss", action="store_true", help="CPU: skip the peak-RSS child processes")
    ap.add_argument("--budget-gib", type=float, default=64.0,
                    help="the memory budget the plan's chooser resolves auto against (default: roomy)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA/--sequential: torch.profiler over 3 steps of each approach (top kernels, top host ops)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense peak for the precision (e.g. 989 for an H100/H200 in bf16): adds MFU")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.only and set(args.only) - set(APPROACHES):
        ap.error(f"--only: unknown {sorted(set(args.only) - set(APPROACHES))}")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.device == "cpu":  # the threads apply would run this config with (apr/threads.py)
        from apr.threads import apply_thread_policy, describe

        choice = apply_thread_policy(make_config(args, engine="interleaved", clip_mode="global"))
        print(f"threads: {describe(choice)}", file=sys.stderr)
    if args.rss_child:
        rss_child(args)
        return
    res = run(args)
    print(json.dumps(res, indent=2) if args.json else render(res))


if __name__ == "__main__":
    main()
