"""bf16 autocast against fp32 on the CPU (docs/performance.md, "bf16 on the CPU"; issue 53 item 2).

Two parts, both in this process's machine conditions (the load average is printed with each):

1. matmul throughput, one thread: GFLOP/s of fp32 and bf16 ``a @ b`` at the demo's and a 30M
   model's shapes (median of 5 x 5 products). A CPU with bf16 dot-product instructions
   (``avx512_bf16`` in /proc/cpuinfo) or AMX runs bf16 faster; without them torch emulates it.
2. the demo (configs/train/demo-tiny.yaml, or --config), trained end to end by `apr train apply`
   with ``training.mixed_precision`` fp32 and bf16 (fp32 master weights, autocast), alternating,
   --repeats times each: wall time, the run's median tokens/s (its training_state.json) and its
   final training and validation loss. The demo's data must exist: run scripts/demo.sh once, or
   its steps 1-2 with APR_DEMO_OUT, and pass --workdir (the folder holding demo-run/).

    .venv/bin/python benchmarks/bench_cpu_bf16.py [--workdir DIR] [--repeats 1] [--max-steps N]
        [--no-train] [--no-matmul]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = ((2048, 128, 384), (2048, 384, 128), (2048, 128, 2048), (2048, 512, 1408), (512, 512, 8192))


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return ", ".join(have) or "none of avx512_bf16, amx_bf16, avx512f, avx2"


def matmuls() -> list[dict]:
    import torch

    torch.set_num_threads(1)
    out = []
    for n, k, m in SHAPES:
        row = {"shape": f"{n}x{k} @ {k}x{m}"}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = torch.randn(n, k, dtype=dtype), torch.randn(k, m, dtype=dtype)
            for _ in range(3):
                a @ b
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(5):
                    a @ b
                times.append((time.perf_counter() - t0) / 5)
            row[name] = 2 * n * k * m / statistics.median(times) / 1e9
        out.append(row)
    return out


def train(workdir: Path, config: Path, precision: str, tag: str, max_steps: int | None) -> dict:
    out = workdir / f"bf16-bench-{precision}-{tag}"
    env = dict(os.environ, APR_HOME=str(workdir / "apr-home"), NO_COLOR="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "apr", "train", "apply", str(config.resolve()),
           f"training.mixed_precision={precision}", f"training.output_dir={out}",
           f"monitoring.tracking.experiment=bf16-bench-{precision}"]
    if max_steps:
        cmd.append(f"--max-steps={max_steps}")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"precision": precision, "error": (done.stderr.strip().splitlines() or ["?"])[-1], "load": load}
    state = json.loads((out / "training_state.json").read_text())
    rates = [v for _, v in state.get("tokens_per_s_history") or [] if v]
    val = state.get("val_loss_history") or []
    losses = state.get("loss_history") or []
    return {"precision": precision, "wall_s": wall, "tokens_per_s": statistics.median(rates) if rates else None,
            "final_loss": losses[-1][1] if losses else None, "final_val_loss": val[-1][1] if val else None,
            "load": load, "load_end": os.getloadavg()[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=REPO, help="the folder holding demo-run/ (data, tokenizer)")
    p.add_argument("--config", type=Path, default=REPO / "configs/train/demo-tiny.yaml")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-matmul", action="store_true")
    args = p.parse_args()
    import torch

    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, CPU flags: {cpu_flags()}, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), load {os.getloadavg()[0]:.2f}")
    if not args.no_matmul:
        print("| matmul, 1 thread | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 |")
        print("| --- | --- | --- | --- |")
        for row in matmuls():
            print(f"| {row['shape']} | {row['fp32']:.1f} | {row['bf16']:.1f} | {row['bf16'] / row['fp32']:.2f}x |")
        print(f"(load after: {os.getloadavg()[0]:.2f})")
    if args.no_train:
        return 0
    runs = []
    for r in range(args.repeats):
        for precision in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
            res = train(args.workdir, args.config, precision, str(r), args.max_steps)
            print(f"  {precision} run {r + 1}: {res}", file=sys.stderr, flush=True)
            runs.append(res)
    print("| run | precision | wall s | median tokens/s | final train loss | final val loss | load at start |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, res in enumerate(runs):
        if "error" in res:
            print(f"| {i + 1} | {res['precision']} | failed: {res['error']} | | | | {res['load']:.2f} |")
            continue
        fmt = (lambda v, spec: "-" if v is None else format(v, spec))  # noqa: E731
        print(f"| {i + 1} | {res['precision']} | {res['wall_s']:.1f} | {fmt(res['tokens_per_s'], ',.0f')} | "
              f"{fmt(res['final_loss'], '.4f')} | {fmt(res['final_val_loss'], '.4f')} | {res['load']:.2f} |")
    ok = {pr: [x for x in runs if x["precision"] == pr and "error" not in x] for pr in ("fp32", "bf16")}
    if all(ok.values()):
        f32, b16 = ok["fp32"], ok["bf16"]
        speed = statistics.median(x["tokens_per_s"] for x in b16) / statistics.median(x["tokens_per_s"] for x in f32)
        vb, vf = (statistics.median(x["final_val_loss"] for x in runs_of) for runs_of in (b16, f32))
        print(f"bf16 / fp32 tokens/s: {speed:.2f}x; final val loss bf16 {vb:.4f} vs fp32 {vf:.4f} "
              f"({(vb / vf - 1) * 100:+.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
