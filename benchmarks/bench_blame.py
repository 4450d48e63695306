"""The cost of recording each row's loss at log steps (`apr runs blame`) against the step time
(docs/performance.md, "Blame: per-row losses").

One model, one engine, the same random token batches. Each round runs ``--log-interval`` training
steps and then, as the run loop's log step does, reads the loss to the host. In the "on" rounds the
last step runs inside ``capture_row_losses`` (apr/kernels/linear_ce.py: one logsumexp per loss chunk)
and the log step then does what apr/train/blame.py does: the rows to the host, one dict each, and
(what the recorder's worker thread does meanwhile) their insert into a SQLite store's
``row_losses``. On and off rounds alternate so drift on a shared machine hits both alike.

Reported:
  step ms          median plain engine step time
  captured ms      median time of a captured step (the last of an "on" round), beside the median last
                   step of an "off" round (the same place in the round, not captured)
  record ms        median host-side record time (rows to the host and their SQLite insert)
  cost             (captured - last plain + record) / (log_interval x step ms): the share of training time
  round on/off     median wall time of whole rounds with and without it (noisy cross-check)

    .venv/bin/python benchmarks/bench_blame.py [--device cpu|cuda] [--hidden 512] [--layers 8]
        [--heads 8] [--intermediate 1408] [--vocab 32000] [--seq 256] [--batch 4] [--accum 1]
        [--log-interval 10] [--rounds 6] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from apr.steps.resolved import resolve as plan_of  # noqa: E402

LR = 3e-4
SEED = 1234
RUN_ID = "20261128-000000-b1a4e0"


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
        "training": {"grad_clip": 1.0, "mixed_precision": "bf16" if cuda else "fp32", "device": args.device,
                     "kernels": "auto" if cuda else "torch", "seed": SEED, "log_interval": args.log_interval,
                     "gradient_accumulation": args.accum},
    })


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def record(captured, step: int, args, writer) -> int:
    """apr/train/blame.py's record on one process, with the recorder's store insert."""
    from apr.track.store import Batch

    losses = torch.stack(captured[-args.accum:]).float().cpu().tolist()
    rows = [(RUN_ID, step, step * args.accum + k, step * 64 + j, None, f"shard-{j % 7:05d}.parquet", j,
             loss / args.seq) for k, micro in enumerate(losses) for j, loss in enumerate(micro)]
    writer.write(Batch(run={"id": RUN_ID, "experiment": "bench", "status": "running"}, row_losses=rows))
    return len(rows)


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each kind (on and off), after one warmup round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)

    from apr.kernels.linear_ce import capture_row_losses
    from apr.model.spec import trainable_param_count
    from apr.track.store import Batch, StoreWriter
    from apr.train.build import build_engine

    device = torch.device(args.device)
    config = make_config(args)
    engine = build_engine(plan_of(config), device)
    gen = torch.Generator().manual_seed(SEED)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(8)]
    writer = StoreWriter(Path(tempfile.mkdtemp()) / "experiments.db")
    writer.write(Batch(run={"id": RUN_ID, "experiment": "bench", "status": "running", "started": time.time()},
                       register={"params": {}}))
    plain, captured_ms, last_plain, record_ms = [], [], [], []
    rounds: dict[bool, list[float]] = {True: [], False: []}
    load_before, k, rows = loadavg(), 0, 0
    for r in range(1 + 2 * args.rounds):
        on = r % 2 == 0
        sync(device)
        t_round = time.perf_counter()
        for i in range(args.log_interval):
            micro = [data[(k + a) % len(data)] for a in range(args.accum)]
            last = i == args.log_interval - 1
            t0 = time.perf_counter()
            if on and last:
                with capture_row_losses() as captured:
                    result = engine.train_step(micro, LR)
            else:
                result = engine.train_step(micro, LR)
            sync(device)
            if r:
                took = time.perf_counter() - t0
                (captured_ms if on and last else plain).append(took)
                if last and not on:
                    last_plain.append(took)
            k += args.accum
        float(result.loss.item())  # the log step's own host read
        if on:
            t0 = time.perf_counter()
            rows = record(captured, k, args, writer)
            if r:
                record_ms.append(time.perf_counter() - t0)
        if r:
            rounds[on].append(time.perf_counter() - t_round)
    writer.close()
    step, cap, last_step, rec = (1e3 * statistics.median(v) for v in (plain, captured_ms, last_plain, record_ms))
    on_s, off_s = statistics.median(rounds[True]), statistics.median(rounds[False])
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine, "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "loadavg_before": load_before, "loadavg_after": loadavg(),
        "params": trainable_param_count(config), "batch": args.batch, "accum": args.accum, "seq": args.seq,
        "vocab": args.vocab, "log_interval": args.log_interval, "rounds": args.rounds, "rows_per_log_step": rows,
        "step_ms": round(step, 2), "captured_step_ms": round(cap, 2), "last_plain_step_ms": round(last_step, 2),
        "record_ms": round(rec, 3), "cost_pct": round(100 * (cap - last_step + rec) / (args.log_interval * step), 3),
        "round_on_s": round(on_s, 3), "round_off_s": round(off_s, 3),
        "round_ratio_pct": round(100 * (on_s / off_s - 1), 2),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['date']}  {machine}  torch {torch.__version__}  load {load_before} -> {out['loadavg_after']}")
    print(f"{out['params'] / 1e6:.1f}M params, batch {args.batch} x accum {args.accum} x seq {args.seq}, vocab "
          f"{args.vocab}, log_interval {args.log_interval}, {args.rounds} rounds each, {rows} rows a log step")
    print(f"step ms       {step:10.1f}")
    print(f"captured ms   {cap:10.1f}   last plain step ms {last_step:.1f}   record ms {rec:.2f}")
    print(f"cost          {out['cost_pct']:.3f}% of the steps between two log steps")
    print(f"round on/off  {on_s:.3f} s / {off_s:.3f} s   ratio {out['round_ratio_pct']:+.2f}% (noisy cross-check)")


if __name__ == "__main__":
    main()
