"""What `apr profile` adds to the step it measures (docs/performance.md, "apr profile: overhead").

``apr.profile.step.profile_step`` alternates unprofiled and profiled steps of one model on the same
batch and reports both medians; this script runs it for a few model sizes and prints the overhead
(median profiled / median unprofiled - 1) with the spread of the unprofiled steps, so a reader can
tell overhead from noise. On a shared machine wall time is noisy (other processes take the
cores), so the same alternation is repeated timing each step's CPU time (``time.process_time`` of
this process, one thread): what the hooks cost in work, whatever else runs.

    .venv/bin/python benchmarks/bench_profile.py [--steps 10] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from apr.config.schema import Architecture
from apr.model.llama import build_model
from apr.profile.clock import Clock
from apr.profile.step import _Recorder, _Step, profile_step

CASES = {  # name: (hidden, layers, heads, intermediate, vocab, batch, seq)
    "tiny": (64, 2, 4, 128, 384, 1, 32),
    "small": (256, 4, 4, 688, 8192, 2, 128),
    "medium": (512, 8, 8, 1408, 32000, 4, 256),
}


def run_case(name, hidden, layers, heads, inter, vocab, batch, seq, steps) -> dict:
    """One model: ``steps`` profiled steps interleaved with as many plain ones (profile_step), then
    the overhead by medians and by minima (the minimum is the least disturbed by other load)."""
    arch = Architecture.model_validate({
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": seq})
    model = build_model(arch, seed=0)
    p = profile_step(model, batch_size=batch, seq_len=seq, steps=steps)
    plain = p.unprofiled_samples_s
    spread = (max(plain) - min(plain)) / statistics.median(plain)  # an overhead below this is noise
    min_overhead = min(p.profiled_samples_s) / min(plain) - 1
    cpu_plain, cpu_profiled = cpu_times(model, batch, seq, steps)
    return {"case": name, "params": sum(x.numel() for x in model.parameters()), "batch": batch, "seq": seq,
            "unprofiled_ms": round(p.unprofiled_step_s * 1e3, 3), "profiled_ms": round(p.step_s * 1e3, 3),
            "overhead": round(p.overhead_fraction, 4), "overhead_of_minima": round(min_overhead, 4),
            "plain_spread": round(spread, 4), "steps": steps,
            "cpu_unprofiled_ms": round(statistics.median(cpu_plain) * 1e3, 3),
            "cpu_profiled_ms": round(statistics.median(cpu_profiled) * 1e3, 3),
            "cpu_overhead": round(statistics.median(cpu_profiled) / statistics.median(cpu_plain) - 1, 4)}


def cpu_times(model, batch: int, seq: int, steps: int) -> tuple[list[float], list[float]]:
    """CPU seconds of ``steps`` plain and ``steps`` profiled steps, alternating (after one warm-up)."""
    step, clock = _Step(model, batch, seq, "fp32"), Clock(torch.device("cpu"))
    step()
    plain, profiled = [], []
    for _ in range(steps):
        t0 = time.process_time()
        step()
        plain.append(time.process_time() - t0)
        rec = _Recorder(model, clock)
        t0 = time.process_time()
        step(rec)
        profiled.append(time.process_time() - t0)
        rec.remove()
    return plain, profiled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cases", default="tiny,small,medium", help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [run_case(name, *CASES[name], steps=args.steps) for name in args.cases.split(",")]
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return
    print(meta)
    for r in rows:
        print(f"{r['case']:>7} {r['params']:>11,} params  b{r['batch']} s{r['seq']}: "
              f"unprofiled {r['unprofiled_ms']} ms, "
              f"profiled {r['profiled_ms']} ms, overhead {100 * r['overhead']:+.2f}% "
              f"(of minima {100 * r['overhead_of_minima']:+.2f}%) "
              f"(plain-step spread {100 * r['plain_spread']:.1f}%); CPU time {r['cpu_unprofiled_ms']} -> "
              f"{r['cpu_profiled_ms']} ms, overhead {100 * r['cpu_overhead']:+.2f}%")


if __name__ == "__main__":
    main()
