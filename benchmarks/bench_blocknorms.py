"""The cost of per-block telemetry (`monitoring.block_norms`) against the step time
(docs/performance.md, "Per-block telemetry").

One model, one engine, the same random token batches. Each round runs ``--log-interval`` training
steps and then, as the run loop's log step does, reads the step's loss and gradient norm to the
host; in the "on" rounds the log step also calls ``apr.train.blocknorms.block_metrics`` (per-group
gradient norms kept by the engine, update norms derived from AdamW's state). On and off rounds
alternate (on, off, on, off, ...) so drift on a shared machine hits both alike.

Reported:
  step ms          median engine step time (train_step, device synchronized)
  telemetry ms     median time of one block_metrics call (its host read included)
  cost             telemetry ms / (log_interval x step ms): the share of training time it adds
  round on/off     median wall time of a whole round with and without it, and their ratio - 1
                   (noisier: a cross-check of the direct figure)

    .venv/bin/python benchmarks/bench_blocknorms.py [--device cpu|cuda] [--engine interleaved|standard]
        [--hidden 512] [--layers 8] [--heads 8] [--intermediate 1408] [--vocab 32000] [--seq 256]
        [--batch 4] [--log-interval 10] [--rounds 6] [--threads N] [--json]
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
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from apr.steps.resolved import resolve as plan_of  # noqa: E402

LR = 3e-4
SEED = 1234


def make_config(args):
    from apr.config.schema import AprConfig

    cuda = args.device == "cuda"
    return AprConfig.model_validate({
        "model": {"architecture": {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads, "intermediate_size": args.intermediate, "vocab_size": args.vocab,
            "max_position_embeddings": args.seq}},
        "data": {"train": "unused/", "batch_size": args.batch, "seq_len": args.seq},
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "training": {"engine": args.engine, "grad_clip": 1.0, "mixed_precision": "bf16" if cuda else "fp32",
                     "device": args.device, "kernels": "auto" if cuda else "torch", "seed": SEED,
                     "log_interval": args.log_interval},
    })


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--engine", default="interleaved", choices=("interleaved", "standard"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each kind (on and off), after one warmup round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from apr.model.spec import trainable_param_count
    from apr.train.blocknorms import block_metrics
    from apr.train.build import build_engine

    device = torch.device(args.device)
    config = make_config(args)
    engine = build_engine(plan_of(config), device)
    gen = torch.Generator().manual_seed(SEED)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(8)]
    step_times: list[float] = []
    telemetry_times: list[float] = []
    rounds: dict[bool, list[float]] = {True: [], False: []}
    load_before = loadavg()
    k = 0
    for r in range(1 + 2 * args.rounds):
        on = r % 2 == 0
        sync(device)
        t_round = time.perf_counter()
        for _ in range(args.log_interval):
            t0 = time.perf_counter()
            result = engine.train_step([data[k % len(data)]], LR)
            sync(device)
            if r:
                step_times.append(time.perf_counter() - t0)
            k += 1
        float(result.loss.item()), float(result.grad_norm.item())  # the log step's own host reads
        if on:
            t0 = time.perf_counter()
            metrics = block_metrics(engine, LR)
            sync(device)
            if r:
                telemetry_times.append(time.perf_counter() - t0)
        if r:  # round 0 warms up
            rounds[on].append(time.perf_counter() - t_round)
    step_ms = 1e3 * statistics.median(step_times)
    tele_ms = 1e3 * statistics.median(telemetry_times)
    on_s, off_s = statistics.median(rounds[True]), statistics.median(rounds[False])
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine, "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "loadavg_before": load_before, "loadavg_after": loadavg(),
        "engine": args.engine, "params": trainable_param_count(config), "batch": args.batch, "seq": args.seq,
        "layers": args.layers, "log_interval": args.log_interval, "rounds": args.rounds,
        "step_ms": round(step_ms, 2), "telemetry_ms": round(tele_ms, 3),
        "cost_pct": round(100 * tele_ms / (args.log_interval * step_ms), 3),
        "round_on_s": round(on_s, 3), "round_off_s": round(off_s, 3),
        "round_ratio_pct": round(100 * (on_s / off_s - 1), 2),
        "max_block_grad_norm": metrics.get("max_block_grad_norm"),
        "max_block_update_norm": metrics.get("max_block_update_norm"),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['date']}  {machine}  torch {torch.__version__}  load {load_before} -> {out['loadavg_after']}")
    print(f"{args.engine} engine, {out['params'] / 1e6:.1f}M params, {args.layers} blocks, batch {args.batch} x "
          f"seq {args.seq}, log_interval {args.log_interval}, {args.rounds} rounds each")
    print(f"step ms       {step_ms:10.1f}")
    print(f"telemetry ms  {tele_ms:10.2f}   cost {out['cost_pct']:.3f}% of the steps between two log steps")
    print(f"round on/off  {on_s:.3f} s / {off_s:.3f} s   ratio {out['round_ratio_pct']:+.2f}% (noisy cross-check)")


if __name__ == "__main__":
    main()
