"""Measured GPU memory of real training steps next to the plan's memory model, for calibrating the
coefficients in apr/memory/activations.py (docs/design.md, "The buffer plan").

For each (config, batch, seq) case it builds the engine on CUDA the way `apr train apply` does
(apr.train.engine.build_engine), runs --warmup + --steps training steps on random token ids, and
reads torch's allocator counters and the device's used memory. Each case runs in its own
subprocess (unless --no-isolate) so peaks and fragmentation do not leak between cases.

Measured, and the plan rows they calibrate:
  buffers      memory_allocated() after the engine is built, before any step
               -> the buffer-plan rows (weights, adamw_m, adamw_v, gradients, ...)
  step peak    max_memory_allocated() over the steps, minus "buffers"
               -> the step-time rows (activation_checkpoints, block_activations, logits_chunk, inputs)
  reserved     max_memory_reserved() + CuPy's memory pool, minus the allocated peak
               -> allocator_slack
  context      device memory in use (cudaMemGetInfo) minus reserved and CuPy's pool
               -> cuda_context
The issue's acceptance measure is "peak": max_memory_reserved() + CuPy's pool, against the plan's
total without cuda_context; "device" compares the device's used memory with the plan's total.

    .venv/bin/python benchmarks/vram_calibration.py                  # the default matrix (below)
    .venv/bin/python benchmarks/vram_calibration.py configs/train/pretrain-50m.yaml --batch 4 --seq 1024
    ... [--steps 3] [--warmup 1] [--kernels auto|cupy|torch] [--json OUT] [--no-isolate]

Default matrix: 50M at (batch, seq) (8, 512), (4, 1024), (2, 2048); 350M at (4, 512), (4, 1024),
(1, 2048), (8, 1024). On a machine without a CUDA device it prints "no CUDA device: skipped" and
exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from apr.steps.resolved import resolve as plan_of

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MiB = 2**20
DEFAULT_MATRIX = [
    ("configs/train/pretrain-50m.yaml", 8, 512),
    ("configs/train/pretrain-50m.yaml", 4, 1024),
    ("configs/train/pretrain-50m.yaml", 2, 2048),
    ("configs/train/pretrain-350m-v2.yaml", 4, 512),
    ("configs/train/pretrain-350m-v2.yaml", 4, 1024),
    ("configs/train/pretrain-350m-v2.yaml", 1, 2048),
    ("configs/train/pretrain-350m-v2.yaml", 8, 1024),
]
BUFFER_ROWS = {"weights", "adamw_m", "adamw_v", "gradients"}  # what build_engine allocates up front
STEP_ROWS = {"activation_checkpoints", "block_activations", "logits_chunk", "inputs"}


def case_config(path: str, batch: int | None, seq: int | None, kernels: str | None):
    """The config at ``path`` with batch/seq overridden, on CUDA (RoPE table long enough for seq)."""
    from apr.config.loader import load_config
    from apr.config.schema import AprConfig

    doc = load_config(REPO / path if not Path(path).is_absolute() else path).config.model_dump(mode="json")
    if batch:
        doc["data"]["batch_size"] = batch
    if seq:
        doc["data"]["seq_len"] = seq
        arch = doc["model"]["architecture"]
        arch["max_position_embeddings"] = max(arch["max_position_embeddings"], seq)
    doc["training"]["device"] = "cuda"
    if kernels:
        doc["training"]["kernels"] = kernels
    return AprConfig.model_validate(doc)


def cupy_pool_bytes() -> int:
    try:
        import cupy

        return int(cupy.get_default_memory_pool().total_bytes())
    except Exception:
        return 0


def measure(path: str, batch: int | None, seq: int | None, steps: int, warmup: int, kernels: str | None) -> dict:
    import torch

    from apr.memory.activations import COEFFICIENTS
    from apr.memory.table import memory_table
    from apr.train.build import build_engine

    config = case_config(path, batch, seq, kernels)
    b, s = config.data.batch_size, config.data.seq_len
    vocab = config.model.architecture.vocab_size
    accum = config.training.gradient_accumulation
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free0, total = torch.cuda.mem_get_info()
    engine = build_engine(plan_of(config))
    torch.cuda.synchronize()
    buffers = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for k in range(warmup + steps):
        micro = [torch.randint(0, vocab, (b, s + 1), generator=gen) for _ in range(accum)]
        result = engine.train_step(micro, lr=1e-4)
        if k >= warmup:
            losses.append(float(result.loss.item()))  # a read at the end of the step, as at log intervals
    torch.cuda.synchronize()
    peak_alloc = torch.cuda.max_memory_allocated()
    peak_reserved = torch.cuda.max_memory_reserved()
    pool = cupy_pool_bytes()
    free1, _ = torch.cuda.mem_get_info()
    device_used = total - free1

    rows = memory_table(config)
    plan = {r.component: r.bytes for r in rows}
    plan_total = sum(plan.values())
    plan_no_ctx = plan_total - plan.get("cuda_context", 0)
    measured = {
        "buffers": buffers,
        "step_peak_above_buffers": peak_alloc - buffers,
        "max_allocated": peak_alloc,
        "max_reserved": peak_reserved,
        "cupy_pool": pool,
        "reserved_slack": peak_reserved + pool - peak_alloc,
        "device_used": device_used,
        "context_and_other": device_used - peak_reserved - pool,
        "device_used_before_engine": total - free0,
    }
    return {
        "config": path, "batch_size": b, "seq_len": s, "precision": str(config.training.mixed_precision),
        "engine": str(config.training.engine), "clip_mode": str(config.training.clip_mode),
        "kernels": engine.backend.name, "steps": steps, "losses": losses,
        "plan_rows": plan, "plan_total": plan_total, "plan_total_without_context": plan_no_ctx,
        "plan_buffers": sum(v for k, v in plan.items() if k in BUFFER_ROWS),
        "plan_step": sum(v for k, v in plan.items() if k in STEP_ROWS),
        "measured": measured,
        "peak": peak_reserved + pool,
        "peak_ratio_plan_over_measured": plan_no_ctx / max(1, peak_reserved + pool),
        "device_ratio_plan_over_measured": plan_total / max(1, device_used),
        "coefficients": COEFFICIENTS.source,
    }


def report(r: dict) -> str:
    m = r["measured"]
    lines = [f"== {r['config']}  batch {r['batch_size']}  seq {r['seq_len']}  {r['precision']}  {r['engine']}/"
             f"{r['clip_mode']}  kernels {r['kernels']}  (losses {', '.join(f'{x:.3f}' for x in r['losses'])})",
             f"{'component':26s} {'plan MiB':>10s}"]
    for comp, nbytes in r["plan_rows"].items():
        lines.append(f"{comp:26s} {nbytes / MiB:10.1f}")
    lines += [
        f"{'':26s} {'plan MiB':>10s} {'measured MiB':>13s} {'plan/meas':>9s}",
        *(f"{label:26s} {p / MiB:10.1f} {q / MiB:13.1f} {p / max(1, q):9.3f}" for label, p, q in [
            ("buffers (up front)", r["plan_buffers"], m["buffers"]),
            ("step (above buffers)", r["plan_step"], m["step_peak_above_buffers"]),
            ("allocator slack", r["plan_rows"].get("allocator_slack", 0), m["reserved_slack"]),
            ("context and other", r["plan_rows"].get("cuda_context", 0), m["context_and_other"]),
            ("PEAK (reserved + CuPy)", r["plan_total_without_context"], r["peak"]),
            ("DEVICE (used)", r["plan_total"], m["device_used"]),
        ]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="config files (default: the matrix in this file's docstring)")
    ap.add_argument("--batch", type=int, help="override data.batch_size for the given configs")
    ap.add_argument("--seq", type=int, help="override data.seq_len for the given configs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kernels", choices=["auto", "cupy", "torch"], help="override training.kernels")
    ap.add_argument("--json", type=Path, help="write every case's measurements here")
    ap.add_argument("--no-isolate", action="store_true", help="run every case in this process")
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # one case, JSON on stdout
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    cases = [(c, args.batch, args.seq) for c in args.configs] if args.configs else DEFAULT_MATRIX
    if args.single:
        (path, batch, seq), = cases
        print("APR_CALIBRATION " + json.dumps(measure(path, batch, seq, args.steps, args.warmup, args.kernels)))
        return 0

    results, failures = [], []
    for path, batch, seq in cases:
        if args.no_isolate:
            try:
                r = measure(path, batch, seq, args.steps, args.warmup, args.kernels)
            except torch.cuda.OutOfMemoryError as err:
                failures.append({"config": path, "batch_size": batch, "seq_len": seq, "error": f"OOM: {err}"})
                print(f"== {path} batch {batch} seq {seq}: out of memory")
                torch.cuda.empty_cache()
                continue
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), path, "--single", "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            cmd += ["--batch", str(batch)] if batch else []
            cmd += ["--seq", str(seq)] if seq else []
            cmd += ["--kernels", args.kernels] if args.kernels else []
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("APR_CALIBRATION ")), None)
            if proc.returncode != 0 or line is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
                failures.append({"config": path, "batch_size": batch, "seq_len": seq, "error": "\n".join(tail)})
                print(f"== {path} batch {batch} seq {seq}: failed\n   " + "\n   ".join(tail))
                continue
            r = json.loads(line.removeprefix("APR_CALIBRATION "))
        results.append(r)
        print(report(r), flush=True)

    if results:
        print("\nsummary: plan total (without context) / measured peak (reserved + CuPy pool)")
        for r in results:
            print(f"  {Path(r['config']).stem:22s} b={r['batch_size']:<2d} s={r['seq_len']:<5d} "
                  f"{r['peak_ratio_plan_over_measured']:.3f}  (device: {r['device_ratio_plan_over_measured']:.3f})")
    if args.json:
        import torch as _t

        props = _t.cuda.get_device_properties(0)
        doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "gpu": props.name,
               "vram_bytes": props.total_memory, "torch": _t.__version__, "cuda": _t.version.cuda,
               "cases": results, "failures": failures}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if failures and not results else 0


if __name__ == "__main__":
    sys.exit(main())
