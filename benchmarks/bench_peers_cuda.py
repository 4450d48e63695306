"""apr against litgpt and torchtitan on a GPU (issue 40's GPU table; docs/performance.md, "Peers on
a GPU"): the 350M config at seq 1024 in bf16 by default, engine level, one process.

The approaches are bench_peers.py's, built on the GPU: the plain loop (bench_engine's baseline, bf16
autocast over fp32 weights), apr's engine with `execution: auto` (and `+compile`), litgpt's GPT with
`pretrain`'s step (autocast bf16 as its "bf16-mixed", fused AdamW as pretrain on CUDA; `+compile`
as pretrain always does), torchtitan's Llama3Model with its trainer's loss and step (flex attention,
autocast bf16 as its mixed-precision policy, fused AdamW). All start from apr's initial weights and
see the same batches; step 1's loss is checked against the loop's (2e-2 relative: bf16).

On a GPU the approaches run one after another, not round-robin, so that the allocator's peak is
each one's own: build, warm-up steps, timed steps (wall time, synchronized), peak memory
(`torch.cuda.max_memory_allocated`), freed. Reported per approach: ms/step (median, min-max),
tokens/s, the loop's over its ms/step, MFU (apr's FLOPs per token from apr/model/spec.py over the
GPU's dense bf16 peak: --peak-tflops, or known for H100/H200/A100), peak GiB, step-1 loss.

torchtitan's own Trainer (its TOML config, its data loader, FSDP on one GPU) is not run: this times
its model code in the same step as the others; say so beside the numbers.

    PYTHONPATH=. python benchmarks/bench_peers_cuda.py
        [--only baseline,apr,apr+compile,litgpt,litgpt+compile,torchtitan]
        [--steps 10] [--warmup 3] [--batch 8] [--json]
    PYTHONPATH=. python benchmarks/bench_peers_cuda.py --device cpu --hidden 64 --layers 2 --heads 4 --kv-heads 2 \\
        --intermediate 128 --vocab 512 --seq 64 --batch 2 --precision fp32   # the same path, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine  # noqa: E402
import bench_peers  # noqa: E402
import torch  # noqa: E402

# dense bf16 tensor-core peaks, TFLOP/s (vendor figures without sparsity), by device name
PEAKS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 125.0))
SHAPE_350M = {"hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 4, "intermediate": 4096, "vocab": 32768,
              "seq": 1024, "batch": 8}


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((tf for key, tf in PEAKS if key in name), None)


def measure(args, name: str, weights: dict, arch, batches: list[torch.Tensor]) -> dict:
    """One approach alone: built, warmed, timed; its peak memory; then freed."""
    device = bench_peers._device(args)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = datetime.datetime.now()
    ap = bench_peers.build(args, name, weights, arch)
    bench_engine.warm(ap, batches[:args.warmup], device)
    warm_s = (datetime.datetime.now() - t0).total_seconds()
    for batch in batches[args.warmup:]:
        bench_engine.timed_step(ap, batch, device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    losses = [float(x) for x in ap.losses]
    ap.step_fn = ap.free_fn = None  # the closures held the model and optimizer
    del ap.losses[:]
    return {"approach": name, "note": ap.note, "times": ap.times, "losses": losses, "peak_bytes": peak,
            "warm_s": warm_s}


def run(args) -> dict:
    device = bench_peers._device(args)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_peers_cuda: no CUDA device here (use --device cpu for the tiny smoke run)")
    weights, arch = bench_peers.apr_weights(args)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
               for _ in range(args.warmup + args.steps)]
    measured, skipped = [], {}
    for name in args.only:
        try:
            measured.append(measure(args, name, weights, arch, batches))
        except (bench_peers.Skip, NotImplementedError) as why:
            skipped[name] = str(why)
        except torch.OutOfMemoryError as err:
            skipped[name] = f"out of memory at batch {args.batch}: {str(err).splitlines()[0]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"  {name}: {'skipped: ' + skipped[name] if name in skipped else 'done'}", file=sys.stderr, flush=True)
    from apr.model.spec import flops_per_token

    flops = flops_per_token(arch, args.seq)
    peak = peak_tflops(device, args.peak_tflops)
    tokens = args.batch * args.seq
    base = next((m for m in measured if m["approach"] == "baseline"), None)
    rows = []
    for m in measured:
        med = statistics.median(m["times"])
        rows.append({
            "approach": m["approach"], "ms_median": med * 1e3, "ms_min": min(m["times"]) * 1e3,
            "ms_max": max(m["times"]) * 1e3, "tokens_per_s": tokens / med,
            "vs_baseline": None if base is None else statistics.median(base["times"]) / med,
            "mfu": None if not peak else tokens / med * flops / (peak * 1e12),
            "peak_gib": None if m["peak_bytes"] is None else m["peak_bytes"] / 2**30,
            "loss_step1": m["losses"][0],
            "dloss_step1": None if base is None else abs(m["losses"][0] - base["losses"][0]) / abs(base["losses"][0]),
            "warm_s": m["warm_s"], "note": m["note"]})
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else bench_engine.cpu_name(),
            "python": platform.python_version(), "torch": torch.__version__, "versions": bench_peers._versions(),
            "shape": {**{k: getattr(args, k) for k in SHAPE_350M},
                      "precision": args.precision or ("bf16" if device.type == "cuda" else "fp32")},
            "flops_per_token": flops,
            "peak_tflops": peak, "warmup": args.warmup, "steps": args.steps, "results": rows, "skipped": skipped}


def render(res: dict) -> str:
    s = res["shape"]
    out = [f"bench_peers_cuda  {res['date']}  {res['device']}  python {res['python']}  torch {res['torch']}  "
           f"{res['versions']}",
           f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads ({s['kv_heads']} KV), intermediate "
           f"{s['intermediate']}, vocab {s['vocab']}; batch {s['batch']} x seq {s['seq']}; "
           f"{s['precision']}; {res['warmup']} warm-up + {res['steps']} timed steps, one approach at a time",
           ""]
    head = (f"{'approach':<16} {'ms/step':>8} {'min':>7} {'max':>7} {'tokens/s':>9} {'x loop':>7} {'MFU':>6} "
            f"{'peak GiB':>8} {'dloss@1':>8} {'build+warm s':>12}")
    out += [head, "-" * len(head)]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)
    for r in res["results"]:
        out.append(f"{r['approach']:<16} {r['ms_median']:>8.1f} {r['ms_min']:>7.1f} {r['ms_max']:>7.1f} "
                   f"{r['tokens_per_s']:>9.0f} {fmt(r['vs_baseline'], '.3f'):>7} {fmt(r['mfu'], '.1%'):>6} "
                   f"{fmt(r['peak_gib'], '.2f'):>8} {fmt(r['dloss_step1'], '.1e'):>8} {r['warm_s']:>12.1f}")
    out += ["", f"MFU: {res['flops_per_token'] / 1e9:.2f} GFLOP/token (apr/model/spec.py, forward + backward) "
                f"over {fmt(res['peak_tflops'], '.0f')} TFLOP/s dense bf16. x loop: the plain loop's ms/step "
                "over this one's."]
    out += [f"{r['approach']}: {r['note']}" for r in res["results"]]
    out += [f"{name}: skipped: {why}" for name, why in res["skipped"].items()]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default in SHAPE_350M.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=default)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 autocast on CUDA, fp32 on a CPU")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--budget-gib", type=float, default=64.0, help="the memory apr's execution: auto plans against")
    p.add_argument("--only", type=lambda v: v.split(","), default=list(bench_peers.APPROACHES))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if set(args.only) - set(bench_peers.APPROACHES):
        p.error(f"--only: unknown {sorted(set(args.only) - set(bench_peers.APPROACHES))}")
    res = run(args)
    print(json.dumps(res, indent=2) if args.json else render(res))
    bad = [r["approach"] for r in res["results"] if r["dloss_step1"] is not None and r["dloss_step1"] > 2e-2]
    if bad:
        print(f"step-1 loss differs from the loop's by more than 2e-2: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
