"""What `training.execution.compile` costs and saves on this machine (issue 40; docs/performance.md,
"Compiled blocks: cost and saving"): the numbers `compile: auto` weighs (apr/steps/execution.py,
COMPILE_COST_S and COMPILE_SAVES).

bench_engine's shape (10.5M parameters, batch 8 x seq 256, fp32, one torch thread), the engine of
`execution: auto` (keep + kept gradients). Each measurement is a fresh Python process, as a run or a
resume is:

  cold    inductor's cache folder empty (a first run on a machine)
  warm    the same folder again (a second run, or a resume: apr keeps the cache in $APR_HOME)

In each process: the engine built and --steps steps run eagerly, then the same with compiled
blocks, alternating one eager and one compiled step after the compiled engine's first step
(interleaved A/B in one process). Compile cost = (compiled build + first step) - (eager build +
first step), in wall seconds and in CPU seconds of the process and its children (inductor's C++
compiles run in worker processes); the saving = 1 - compiled / eager per-step CPU time (medians).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_compile.py [--steps 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from apr.steps.resolved import resolve as plan_of

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child(steps: int) -> dict:
    """One process: eager and compiled engines of the same shape; returns the measured seconds."""
    import bench_engine
    import torch

    from apr.train.build import build_engine

    torch.set_num_threads(1)
    args = argparse.Namespace(hidden=256, layers=6, heads=4, kv_heads=4, intermediate=1024, vocab=8192,
                              tied=False, seq=256, batch=8, loss_chunk=256, device="cpu", precision=None,
                              kernels="torch")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(steps + 1)]
    out, engines = {}, {}
    for compiled in (False, True):
        config = bench_engine.make_config(args, engine="interleaved", clip_mode="global",
                                          execution=("keep", "kept"), compile=compiled)
        w0, c0 = time.perf_counter(), _cpu()
        engine = build_engine(plan_of(config))
        float(engine.train_step([batches[0]], 3e-4).loss)
        first = {"first_wall_s": time.perf_counter() - w0, "first_cpu_s": _cpu() - c0}
        out["compiled" if compiled else "eager"] = first
        engines[compiled] = engine
    per = {False: [], True: []}
    for b in batches[1:]:
        for compiled in (False, True):
            t0 = time.thread_time()
            float(engines[compiled].train_step([b], 3e-4).loss)
            per[compiled].append(time.thread_time() - t0)
    out["eager_step_cpu_s"] = statistics.median(per[False])
    out["compiled_step_cpu_s"] = statistics.median(per[True])
    return out


def run(steps: int) -> dict:
    res = {}
    with tempfile.TemporaryDirectory(prefix="apr-bench-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        for label in ("cold", "warm"):
            proc = subprocess.run([sys.executable, __file__, "--child", str(steps)], env=env, capture_output=True,
                                  text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["compile_wall_s"] = r["compiled"]["first_wall_s"] - r["eager"]["first_wall_s"]
            r["compile_cpu_s"] = r["compiled"]["first_cpu_s"] - r["eager"]["first_cpu_s"]
            r["saving"] = 1.0 - r["compiled_step_cpu_s"] / r["eager_step_cpu_s"]
            res[label] = r
    return res


def render(res: dict) -> str:
    lines = [f"{'cache':<6}{'compile wall s':>16}{'compile CPU s':>15}{'eager ms/step':>15}"
             f"{'compiled ms/step':>18}{'saving':>8}"]
    for label, r in res.items():
        lines.append(f"{label:<6}{r['compile_wall_s']:>16.1f}{r['compile_cpu_s']:>15.1f}"
                     f"{r['eager_step_cpu_s'] * 1e3:>15.1f}{r['compiled_step_cpu_s'] * 1e3:>18.1f}"
                     f"{r['saving']:>8.1%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    res = run(args.steps)
    print(json.dumps(res, indent=1) if args.json else render(res))


if __name__ == "__main__":
    main()
