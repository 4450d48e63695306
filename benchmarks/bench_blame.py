"""What recording each row's loss (`apr runs blame`) costs against the step time (docs/performance.md,
"Blame: per-row losses").

The run captures every step (a step may turn out to be the one the run stops at, which is logged)
and records the rows of the logged ones. So the cost is the capture on every step plus the record
once per ``--log-interval`` steps:

  capture   every step runs inside ``capture_row_losses`` (apr/kernels/linear_ce.py): the backend
            writes each position's loss, which it computes for the sum anyway, into one buffer, and
            two reductions give each row's sum. Measured paired and interleaved: the same batch is
            trained twice in a row, once plain and once captured, in alternating order (plain first,
            then captured first, ...), so drift on a shared machine and any order effect hit both
            alike (the figure below). Its parts are also timed alone, many times over: the buffer,
            each chunk's copy into it and the two reductions. The same pairs over the chunked head
            alone (``linear_cross_entropy_fwd_bwd``, the only code the capture touches)
            show where a difference would come from.
  record    apr/train/blame.py's ``RowBlame`` on a real ``ShardLoader`` over random shards: the rows
            of a captured step to the host, located in the data (source, shard, row), one dict each,
            and the recorder's tuples, all on the training thread; timed apart, their SQLite insert
            into ``row_losses``, which the run's recorder does on its worker thread (insert ms).

On the CPU the times are this process's CPU time (``time.process_time``: other processes on a
shared machine take turns on the cores, which wall time counts and CPU time does not; run with
``--threads 1`` so no intra-op pool spins), with the wall-clock figures beside them; on CUDA, wall
time after a synchronize. The paired difference is the mean of two medians, of the pairs run
captured-first and of those run plain-first, which cancels any advantage of running second.

Reported: step ms (median plain engine step), capture ms (the paired difference, with its 95%
bootstrap interval and the quartiles of the pairs), capture parts ms, head ms / head capture ms (the
same for the head alone), record ms and insert ms (medians, wall), and

  cost = (capture ms + (record ms + insert ms) / log_interval) / step ms

the insert counted as if it ran on the training thread (an upper bound), and the same with the
capture's parts timed alone in place of the paired difference ("cost from parts").

    .venv/bin/python benchmarks/bench_blame.py [--device cpu|cuda] [--hidden 512] [--layers 8]
        [--heads 8] [--intermediate 1408] [--vocab 32000] [--seq 256] [--batch 4] [--accum 1]
        [--log-interval 10] [--pairs 30] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
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


def make_config(args, data: str):
    from apr.config.schema import AprConfig

    cuda = args.device == "cuda"
    return AprConfig.model_validate({
        "model": {"architecture": {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads, "intermediate_size": args.intermediate, "vocab_size": args.vocab,
            "max_position_embeddings": args.seq}},
        "data": {"train": data, "batch_size": args.batch, "seq_len": args.seq},
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


def paired(run, pairs: int, device: torch.device) -> dict[str, tuple[list[float], list[float]]]:
    """``run(k)`` timed in ``pairs`` pairs, plain and captured, the order alternating; for each clock
    ("wall", and "cpu": this process's CPU time, which other processes on a shared machine barely
    disturb) the plain seconds and the (captured - plain) seconds of each pair."""
    from apr.kernels.linear_ce import capture_row_losses

    def timed(k: int, captured: bool) -> tuple[float, float]:
        sync(device)
        wall, cpu = time.perf_counter(), time.process_time()
        if captured:
            with capture_row_losses():
                run(k)
        else:
            run(k)
        sync(device)
        return time.perf_counter() - wall, time.process_time() - cpu

    out: dict[str, tuple[list[float], list[float]]] = {"wall": ([], []), "cpu": ([], [])}
    for k in range(pairs):
        first = k % 2 == 0  # captured first in even pairs, second in odd ones
        a = timed(k, first)
        b = timed(k, not first)
        on, off = (a, b) if first else (b, a)
        for i, clock in enumerate(("wall", "cpu")):
            out[clock][0].append(off[i])
            out[clock][1].append(on[i] - off[i])
    return out


def difference(diffs: list[float]) -> float:
    """The captured step's extra time: the mean of the medians of the pairs run captured-first and of
    those run plain-first (the second run of a pair is often faster or slower: this cancels it)."""
    return (statistics.median(diffs[0::2]) + statistics.median(diffs[1::2])) / 2


def interval(diffs: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of ``difference`` (each half resampled on its own)."""
    rng = random.Random(SEED)
    firsts, seconds = diffs[0::2], diffs[1::2]
    est = sorted(difference([x for pair in zip(rng.choices(firsts, k=len(firsts)),
                                               rng.choices(seconds, k=len(seconds)), strict=True) for x in pair])
                 for _ in range(draws))
    return est[int(0.025 * draws)], est[int(0.975 * draws)]


def capture_parts(batch: int, seq: int, chunk_size: int, device: torch.device, repeats: int = 200) -> float:
    """Seconds of what a capture adds to one walk of the head, timed alone: the positions' buffer,
    each chunk's losses written into it (the torch backend's copy; the CuPy kernel writes them in
    place) and the two reductions to each row's sum (apr/kernels/linear_ce.py)."""
    from apr.kernels.linear_ce import _chunks, _row_sums

    chunks = list(_chunks(seq, chunk_size))
    per_chunk = torch.randn(batch * chunk_size, device=device)

    def once():
        positions = torch.empty(batch * seq, dtype=torch.float32, device=device)
        for start, end in chunks:
            positions[batch * start:batch * end].copy_(per_chunk[:batch * (end - start)])
        return _row_sums(positions, batch, seq, chunk_size)

    for _ in range(10):
        once()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        once()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StoreRecorder:
    """The recorder's side of a record (apr/track/recorder.py): ``log_row_losses`` turns the rows into
    tuples on the training thread; ``flush`` inserts them into the local store, which the run's
    recorder does on its worker thread."""

    def __init__(self, writer):
        self.writer, self.pending = writer, []

    def log_row_losses(self, step: int, rows: list[dict]) -> None:
        self.pending.extend((RUN_ID, step, r["micro_batch"], r["index"], r["source"], r["shard"], r["row"],
                             r["loss"]) for r in rows)

    def flush(self) -> None:
        from apr.track.store import Batch

        rows, self.pending = self.pending, []
        self.writer.write(Batch(run={"id": RUN_ID, "experiment": "bench", "status": "running"}, row_losses=rows))


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


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
    ap.add_argument("--pairs", type=int, default=30, help="pairs of steps (plain and captured), after 2 warmup pairs")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)

    from apr.data.loader import ShardLoader
    from apr.data.testing import make_shards
    from apr.kernels.linear_ce import capture_row_losses, linear_cross_entropy_fwd_bwd
    from apr.model.spec import trainable_param_count
    from apr.track.store import Batch, StoreWriter
    from apr.train.blame import RowBlame
    from apr.train.build import build_engine
    from apr.train.cadence import Cadence

    device = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="bench-blame-"))
    make_shards(tmp / "data", n_rows=64 * args.batch * args.accum, seq_len=args.seq, vocab_size=args.vocab,
                rows_per_shard=16 * args.batch)
    config = make_config(args, str(tmp / "data" / "train"))
    engine = build_engine(plan_of(config), device)
    loader = ShardLoader(tmp / "data" / "train", seq_len=args.seq, batch_size=args.batch,
                         gradient_accumulation=args.accum, seed=SEED, cache_dir=False)
    micro = [[loader.next_batch() for _ in range(args.accum)] for _ in range(8)]

    # the engine step, paired
    paired(lambda k: engine.train_step(micro[k % 8], LR), 2, device)  # warmup
    steps = paired(lambda k: engine.train_step(micro[k % 8], LR), args.pairs, device)

    # the chunked head alone (what the capture touches), paired
    backend = engine.backend  # the engine's own kernels (torch on the CPU, CuPy on CUDA when installed)
    gen = torch.Generator().manual_seed(SEED)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device, dtype)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device)

    def head(k):
        linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=config.training.loss_chunk_size,
                                     grad_scale=1.0, backend=backend, grad_weight=grad_weight)

    paired(head, 2, device)
    heads = paired(head, args.pairs, device)

    # the record at a log step: RowBlame over the real loader, into a SQLite store
    writer = StoreWriter(tmp / "experiments.db")
    writer.write(Batch(run={"id": RUN_ID, "experiment": "bench", "status": "running", "started": time.time()},
                       register={"params": {}}))
    cadence = Cadence(log_interval=1, eval_interval=0, save_interval=10**9, total_steps=10**9, validates=False)
    blame = RowBlame(cadence, loader, seq_len=args.seq, accumulation=args.accum, mixture=False)
    recorder, record_s, insert_s = StoreRecorder(writer), [], []
    for k in range(args.pairs):
        with blame.capture(k + 1):
            engine.train_step([loader.next_batch() for _ in range(args.accum)], LR)
        sync(device)
        t0 = time.perf_counter()
        blame.record(k + 1, recorder)
        t1 = time.perf_counter()
        recorder.flush()
        record_s.append(t1 - t0)
        insert_s.append(time.perf_counter() - t1)
    rows = len(blame.rows([[0.0] * args.batch] * args.accum, 0))
    writer.close()

    with capture_row_losses() as walked:  # head walks a step (a clipping norm pre-pass walks it twice)
        engine.train_step(micro[0], LR)
    walks = len(walked)
    parts = capture_parts(args.batch, args.seq, config.training.loss_chunk_size, device) * walks
    clock = "cpu" if device.type == "cpu" else "wall"  # the CPU's own time; a GPU's is wall time after a sync
    ms = 1e3
    step, head_ms = (ms * statistics.median(v[clock][0]) for v in (steps, heads))
    capture, head_capture = (ms * difference(v[clock][1]) for v in (steps, heads))
    wall_step, wall_capture = ms * statistics.median(steps["wall"][0]), ms * difference(steps["wall"][1])
    record, insert = ms * statistics.median(record_s), ms * statistics.median(insert_s)
    q1, q3 = (ms * q for q in quartiles(steps[clock][1]))
    low, high = (ms * q for q in interval(steps[clock][1]))
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads")
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine, "cpu_count": os.cpu_count(), "torch": torch.__version__, "loadavg": loadavg(),
        "params": trainable_param_count(config), "batch": args.batch, "accum": args.accum, "seq": args.seq,
        "vocab": args.vocab, "log_interval": args.log_interval, "pairs": args.pairs, "rows_per_log_step": rows,
        "clock": clock, "step_ms": round(step, 3), "capture_ms": round(capture, 3),
        "capture_iqr_ms": [round(q1, 3), round(q3, 3)], "head_ms": round(head_ms, 3),
        "head_capture_ms": round(head_capture, 3), "record_ms": round(record, 3),
        "insert_ms": round(insert, 3),
        "wall_step_ms": round(wall_step, 3), "wall_capture_ms": round(wall_capture, 3),
        "capture_ci95_ms": [round(low, 3), round(high, 3)], "parts_ms": round(ms * parts, 4), "head_walks": walks,
        "cost_pct": round(100 * (capture + (record + insert) / args.log_interval) / step, 3),
        "cost_ci95_pct": [round(100 * (x + (record + insert) / args.log_interval) / step, 3) for x in (low, high)],
        "cost_parts_pct": round(100 * (ms * parts + (record + insert) / args.log_interval) / step, 4),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['date']}  {machine}  torch {torch.__version__}  load {out['loadavg']}")
    print(f"{out['params'] / 1e6:.1f}M params, batch {args.batch} x accum {args.accum} x seq {args.seq}, vocab "
          f"{args.vocab}, log_interval {args.log_interval}, {args.pairs} pairs, {rows} rows a log step")
    print(f"step ms            {step:10.2f}   (median plain engine step, {clock} time)")
    print(f"capture ms         {capture:+10.3f}   (paired difference; 95% interval {low:+.3f} / {high:+.3f}; "
          f"quartiles of the pairs {q1:+.3f} / {q3:+.3f})")
    print(f"capture parts ms   {ms * parts:10.4f}   (what the capture adds, timed alone, x {walks} head walks a step)")
    print(f"head ms            {head_ms:10.2f}   capture {head_capture:+.3f} (the chunked head alone)")
    print(f"record ms          {record:10.3f}   (RowBlame.record at a log step, on the training thread; wall)")
    print(f"insert ms          {insert:10.3f}   (their SQLite insert: the recorder's worker thread; wall)")
    print(f"cost               {out['cost_pct']:.3f}% of step time (capture + (record + insert) / "
          f"{args.log_interval}); "
          f"95% interval {out['cost_ci95_pct'][0]:.3f}% / {out['cost_ci95_pct'][1]:.3f}%")
    print(f"cost from parts    {out['cost_parts_pct']:.4f}% (capture parts + (record + insert) / "
          f"{args.log_interval})")
    if clock == "cpu":
        print(f"wall clock         step {wall_step:.2f} ms, capture {wall_capture:+.3f} ms (noisy on a shared machine)")


if __name__ == "__main__":
    main()
