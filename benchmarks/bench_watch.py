"""What the training-time watches cost (docs/performance.md, "Drift and histograms during training").

1. ``monitoring.data_drift``: one check (``DataDriftCheck.measure``: a sample of the rows read so far
   and of the rows ahead, from the memory-mapped token cache, then PSI, KS and Wasserstein on token
   ranks and document lengths) on a 100M-token dataset (bench_drift.py's, written once), the cursor
   in the middle of the epoch; beside it the loader's own ``next_batch`` (the baseline: what the run
   already pays per micro-batch).
2. ``monitoring.histograms``: one record (every layer's weights and gradient, ``LayerHistograms``)
   on a model, beside one plain training step of the same model (forward, backward, AdamW:
   ``apr.profile.step._Step``) on the same batch.

Each figure is a median over ``--repeats``; the per-step cost at an interval is the check's time
divided by the interval, as a fraction of the step.

    .venv/bin/python benchmarks/bench_watch.py [--dir /tmp/bench_drift] [--repeats 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drift import EOT, ROW, VOCAB, write  # noqa: E402

from apr.config.schema import Architecture  # noqa: E402
from apr.data.loader import ShardLoader  # noqa: E402
from apr.model.llama import build_model  # noqa: E402
from apr.profile.step import _Step  # noqa: E402
from apr.train.datadrift import DataDriftCheck  # noqa: E402
from apr.train.histograms import LayerHistograms  # noqa: E402

MODELS = {"small": (256, 4, 4, 688, 8192, 2, 128), "medium": (512, 8, 8, 1408, 32000, 4, 256)}


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drift_case(folder: Path, sample_tokens: int, repeats: int) -> dict:
    write(folder / "train", 100_000_000, 20, seed=1)
    cache = folder / "token-cache"  # built once (decoding 100M tokens), then memory-mapped
    t0 = time.perf_counter()
    loader = ShardLoader(folder / "train", seq_len=ROW - 1, batch_size=8, seed=0, cache_dir=cache)
    opened_s = time.perf_counter() - t0
    loader.seek(loader.micro_batches_per_epoch // 2)
    check = DataDriftCheck(interval=1, sample_tokens=sample_tokens, seed=0, vocab_size=VOCAB, eot_id=EOT)
    check.measure(loader, 1)  # the pages of the first sample
    step = iter(range(1, 10**9))
    check_s = _median_s(lambda: check.measure(loader, next(step)), repeats)
    batch_s = _median_s(loader.next_batch, repeats)
    figures = check.measure(loader, 0)
    return {"case": "data_drift", "tokens": int(loader.num_rows * ROW), "sample_tokens": sample_tokens,
            "rows_per_side": figures["rows_read"], "cache_open_s": round(opened_s, 2),
            "check_ms": round(check_s * 1e3, 2), "next_batch_ms": round(batch_s * 1e3, 3)}


def histogram_case(name: str, repeats: int, bins: int = 32) -> dict:
    hidden, layers, heads, inter, vocab, batch, seq = MODELS[name]
    arch = Architecture.model_validate({"hidden_size": hidden, "num_hidden_layers": layers,
                                        "num_attention_heads": heads, "intermediate_size": inter,
                                        "vocab_size": vocab, "max_position_embeddings": seq})
    model = build_model(arch, seed=0)
    step = _Step(model, batch, seq, "fp32")
    step()
    step_s = _median_s(step, repeats)
    hist = LayerHistograms(interval=1, bins=bins)
    groups = [("embed", [model.model.embed_tokens.weight])] + [
        (f"block.{i}", list(layer.parameters())) for i, layer in enumerate(model.model.layers)] + [
        ("head", [model.model.norm.weight, model.lm_head.weight])]

    def record():
        with torch.no_grad():
            for layer, params in groups:
                hist._add("weight", layer, [p.detach() for p in params])
                hist._add("grad", layer, [p.grad for p in params if p.grad is not None])
            pending, hist._pending = hist._pending, {}
            torch.stack([c for c, *_ in pending.values()]).tolist()

    record()
    record_s = _median_s(record, repeats)
    return {"case": f"histograms/{name}", "params": sum(p.numel() for p in model.parameters()),
            "tokens_per_step": batch * seq, "step_ms": round(step_s * 1e3, 2), "record_ms": round(record_s * 1e3, 2),
            "bins": bins}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/bench_drift")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--models", default="small,medium")
    ap.add_argument("--no-drift", action="store_true", help="histograms only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    rows = []
    cases = [] if args.no_drift else [("drift", 65_536), ("drift", 250_000)]
    for case in cases + [("hist", n) for n in args.models.split(",") if n]:
        rows.append(drift_case(Path(args.dir), case[1], args.repeats) if case[0] == "drift"
                    else histogram_case(case[1], args.repeats))
        if not args.json:
            show(rows[-1])
    if args.json:
        print(json.dumps(rows, indent=2))


def show(r: dict) -> None:
    if r["case"] == "data_drift":
        print(f"data drift, {r['tokens'] / 1e6:.0f}M-token cache, {r['sample_tokens']:,} tokens a side "
              f"({r['rows_per_side']} rows): one check {r['check_ms']} ms (next_batch {r['next_batch_ms']} ms; "
              f"cache opened in {r['cache_open_s']} s); at interval 100: {r['check_ms'] / 100:.3f} ms a step",
              flush=True)
    else:
        print(f"{r['case']}: {r['params'] / 1e6:.1f}M params, step {r['step_ms']} ms, one record {r['record_ms']} "
              f"ms = {r['record_ms'] / r['step_ms']:.1%} of a step; at interval 100: "
              f"{r['record_ms'] / r['step_ms'] / 100:.3%} a step", flush=True)

if __name__ == "__main__":
    main()
