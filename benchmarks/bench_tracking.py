"""What recording costs a training step (docs/performance.md, "Run records"): issue 8's target is
under 1% of the step time at `log_interval: 1` for the demo config on the CPU.

1. calls: the training thread's cost of `RunRecorder.log_step` + `check_alerts` alone (3,000
   calls, nothing else running), and the background writer's CPU time per pass.
2. steps: apr's own engine on configs/train/demo-tiny.yaml (0.5M parameters, batch 16 x seq 128,
   fp32, CPU), with the run loop's host reads at every step, in alternating blocks of 5 steps
   with and without a recorder (log_interval 1, the demo's alert, both stores, state file). The
   recorder's share is (training-thread time in the recorder + the writer thread's CPU time) /
   the median plain step; the wall-clock difference between the blocks is printed too (noisy on a
   shared box: it is the check, not the measure).

    .venv/bin/python benchmarks/bench_tracking.py [--steps 60] [--skip-torch]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from apr.steps.resolved import resolve as plan_of

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _demo_config():
    from apr.config import load_config

    loaded = load_config(REPO / "configs" / "train" / "demo-tiny.yaml")
    cfg = loaded.config
    cfg.training.log_interval = 1
    return cfg, loaded.config_hash


def _recorder(tmp: Path, name: str):
    from apr.track.recorder import RunRecorder

    cfg, chash = _demo_config()
    return RunRecorder(tmp / name, cfg, config_hash=chash, total_steps=100_000, tokens_per_step=16 * 128,
                       apr_home=tmp / "home", config_path="configs/train/demo-tiny.yaml", model_params=500_000)


def _instrument(rec) -> dict:
    """Accumulate the background writer's CPU time (thread_time) and pass count."""
    stats = {"cpu_s": 0.0, "passes": 0, "max_s": 0.0}
    work = rec._work

    def timed():
        t0 = time.thread_time()
        try:
            work()
        finally:
            dt = time.thread_time() - t0
            stats["cpu_s"] += dt
            stats["max_s"] = max(stats["max_s"], dt)
            stats["passes"] += 1

    rec._work = timed
    return stats


def _metrics(step: int, loss: float) -> dict:
    return {"loss": loss, "lr": 3e-3, "grad_norm": 0.8, "tokens_per_s": 9000.0, "tokens_seen": step * 2048,
            "epoch": step / 1000, "step": step}


def bench_calls(tmp: Path, n: int = 3000) -> dict:
    """Training-thread cost of log_step + check_alerts with nothing else running."""
    rec = _recorder(tmp, "calls")
    stats = _instrument(rec)
    rec.start()
    samples = []
    for step in range(1, n + 1):
        m = _metrics(step, 3.0)
        t0 = time.perf_counter()
        rec.log_step(step, m)
        rec.check_alerts(m)
        samples.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    rec.finish("finished")
    finish_s = time.perf_counter() - t0
    samples.sort()
    return {
        "calls": n,
        "median_us": statistics.median(samples) * 1e6,
        "mean_us": statistics.fmean(samples) * 1e6,
        "p99_us": samples[int(0.99 * n)] * 1e6,
        "writer_passes": stats["passes"],
        "writer_cpu_us_per_pass": stats["cpu_s"] / max(stats["passes"], 1) * 1e6,
        "finish_s": finish_s,
        "warnings": rec.warnings,
    }


def _demo_step_fn():
    """One optimizer step of apr's own engine on the demo config (CPU, fp32), with the host reads
    the run loop does at a log step (loss and grad norm); random token batches of the demo's shape."""
    import torch

    from apr.train.build import build_engine

    cfg, _ = _demo_config()
    torch.manual_seed(0)
    engine = build_engine(plan_of(cfg), torch.device("cpu"))
    vocab = cfg.model.architecture.vocab_size
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (cfg.data.batch_size, cfg.data.seq_len + 1), generator=gen)
               for _ in range(8)]
    state = {"i": 0}

    def step() -> tuple[float, float]:
        state["i"] += 1
        result = engine.train_step([batches[state["i"] % len(batches)]], cfg.optimizer.lr)
        return float(result.loss.item()), float(result.grad_norm.item())

    return step


def bench_steps(tmp: Path, steps: int) -> dict:
    """apr engine steps on the demo config, alternating blocks of 5 with and without the recorder."""
    step_fn = _demo_step_fn()
    for _ in range(3):
        step_fn()
    rec = _recorder(tmp, "steps")
    stats = _instrument(rec)
    rec.start()
    plain, recorded, rec_main = [], [], []
    n = 0
    for block in range(2 * (steps // 5)):
        with_rec = block % 2 == 1
        for _ in range(5):
            n += 1
            t0 = time.perf_counter()
            loss, grad_norm = step_fn()
            t1 = time.perf_counter()
            if with_rec:
                m = {**_metrics(n, loss), "grad_norm": grad_norm}
                rec.log_step(n, m)
                rec.check_alerts(m)
                rec_main.append(time.perf_counter() - t1)
                recorded.append(time.perf_counter() - t0)
            else:
                plain.append(time.perf_counter() - t0)
    rec.finish("finished")
    step_s = statistics.median(plain)
    main_us = statistics.fmean(rec_main) * 1e6
    main_median_us = statistics.median(rec_main) * 1e6
    worker_us = stats["cpu_s"] / max(len(recorded), 1) * 1e6
    return {
        "steps_each": len(plain),
        "plain_step_ms_median": step_s * 1e3,
        "recorded_step_ms_median": statistics.median(recorded) * 1e3,
        "recorder_main_thread_us_per_step": main_us,
        "recorder_main_thread_us_median": main_median_us,
        "recorder_writer_cpu_us_per_step": worker_us,
        "recorder_writer_passes": stats["passes"],
        "recorder_writer_max_pass_ms": stats["max_s"] * 1e3,
        "recorder_share_of_step_pct": (main_us + worker_us) / (step_s * 1e6) * 100,
        "wall_clock_delta_pct": (statistics.median(recorded) / step_s - 1) * 100,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="engine steps with and without the recorder (each)")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ["APR_HOME"] = str(tmp / "home")
        results = {"calls": bench_calls(tmp)}
        print(json.dumps({"calls": results["calls"]}, indent=2), flush=True)
        if not args.skip_torch:
            results["steps"] = r = bench_steps(tmp, args.steps)
            print(json.dumps({"steps": r}, indent=2), flush=True)
            verdict = "ok" if r["recorder_share_of_step_pct"] < 1.0 else "OVER the 1% target"
            print(f"recording: {r['recorder_share_of_step_pct']:.2f}% of a {r['plain_step_ms_median']:.1f} ms demo "
                  f"step at log_interval 1 ({verdict}); wall-clock delta {r['wall_clock_delta_pct']:+.1f}%")


if __name__ == "__main__":
    main()
