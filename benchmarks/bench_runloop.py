"""What the run loop of ``apr train apply`` costs over the bare engine step (docs/performance.md,
"The run loop's overhead"; issue 40: under 1% at the default log interval).

One process runs a real ``apr train apply`` (``apr.apply.run_apply``: the plan, the run, the
recorder with both stores and the state file, per-block telemetry, the progress bar drawn to a
stand-in terminal, cadence checks, the data loader over Parquet shards) of bench_engine.py's shape
(10.5M parameters, hidden 256, 6 layers, vocab 8192, batch 8 x seq 256, fp32, one torch thread).
A step hook runs, after each of the loop's steps, one step of a second engine built from the same
config and execution policy on pre-made batches: the bare step. So the two alternate step by step
(loop, bare, loop, bare ...) and load that changes over the run hits both alike.

Figures, over the timed steps (after --warmup), CPU time (robust to load on a shared machine):

  loop step        process CPU from one hook's return to the next hook's end: a whole iteration
                   of the loop (data, engine step, records, progress, cadence, hooks, agreement)
  bare step        process CPU of the second engine's ``train_step`` on a ready batch
  host overhead    the main thread's CPU in the iteration outside the loop's own ``train_step``
                   (thread_time: the loop's host work, measured directly rather than as the
                   difference of two large noisy figures), mean per step over whole log intervals
  background       CPU of the process's other threads (the recorder's writer, checkpoint writes)
                   per step: process CPU - main-thread CPU over the timed window

The overhead is (host overhead + background) / median bare step; the paired ratio (median over
steps of loop / bare in the same round) is the cross-check. The whole command's fixed costs (plan,
build, final checkpoint) are printed apart: they do not grow with the run.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_runloop.py [--steps 40] [--warmup 3]
        [--log-interval 10] [--hidden 256] [--layers 6] [--vocab 8192] [--seq 256] [--batch 8] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import io
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
os.environ.setdefault("APR_CPU_THREADS", "1")  # one torch thread, as bench_engine --threads 1

import numpy as np  # noqa: E402

from apr.steps.resolved import resolve as plan_of  # noqa: E402


class FakeTTY(io.StringIO):
    """A terminal stand-in, so the progress bar draws as it would for a user."""

    def isatty(self) -> bool:
        return True


def write_data(folder: Path, rows: int, seq: int, vocab: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).integers(0, vocab, size=(rows, seq + 1)).astype(np.uint32)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * (seq + 1))
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(data.reshape(-1)))}),
                   folder / "shard-00000.parquet")


def write_config(root: Path, args) -> Path:
    from apr.plan.examples import to_yaml

    training = {"max_steps": args.steps + args.warmup, "warmup_steps": 0, "lr_scheduler": "constant",
                "device": "cpu", "mixed_precision": "fp32", "output_dir": str(root / "run"),
                "loss_chunk_size": args.seq, "grad_clip": 1.0}
    if args.log_interval:
        training["log_interval"] = args.log_interval  # else the schema's default
    doc = {"model": {"architecture": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                      "num_attention_heads": 4, "num_key_value_heads": 4,
                                      "intermediate_size": args.hidden * 4, "vocab_size": args.vocab,
                                      "max_position_embeddings": args.seq}},
           "data": {"train": str(root / "data"), "batch_size": args.batch, "seq_len": args.seq},
           "optimizer": {"lr": 3e-4, "weight_decay": 0.1}, "training": training,
           "monitoring": {"tracking": {"experiment": "bench-runloop"}}}
    path = root / "runloop.yaml"
    path.write_text(to_yaml(doc))
    return path


class Pairing:
    """The step hook that times the loop's iterations and runs the bare step between them."""

    def __init__(self, args):
        self.args = args
        self.bare = None
        self.batches = None
        self.rows: list[dict] = []
        self._start: tuple[float, float] | None = None  # (process, main thread) CPU at the last hook's end
        self._in_step = 0.0  # main-thread CPU inside the loop's train_step this iteration
        self.log_interval = None
        self.t_first_step: float | None = None
        self.t_last_hook: float | None = None

    def attach(self, run) -> None:
        import torch

        from apr.train.build import build_engine

        self.log_interval = run.cadence.log_interval
        with torch.random.fork_rng():
            self.bare = build_engine(plan_of(run.config, execution=run.engine.execution), run.device)
        gen = torch.Generator().manual_seed(1)
        a = self.args
        self.batches = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen) for _ in range(4)]
        inner = run.engine.train_step

        def timed_train_step(micro, lr):
            t0 = time.thread_time()
            try:
                return inner(micro, lr)
            finally:
                self._in_step += time.thread_time() - t0

        run.engine.train_step = timed_train_step  # the instance attribute shadows the method
        run.hooks.append(self)

    def after_step(self, run, report):
        proc, main = time.process_time(), time.thread_time()
        if self._start is not None and report.step > self.args.warmup:
            self.rows.append({"step": report.step, "loop_cpu": proc - self._start[0],
                              "host_cpu": (main - self._start[1]) - self._in_step,
                              "background_cpu": (proc - self._start[0]) - (main - self._start[1]),
                              "engine_cpu": self._in_step})
        if report.step == self.args.warmup:
            self.t_first_step = time.perf_counter()
        batch = self.batches[report.step % len(self.batches)]
        p0, m0 = time.process_time(), time.thread_time()
        loss = self.bare.train_step([batch], report.lr).loss
        float(loss)  # as a plain loop would read it
        p1, m1 = time.process_time(), time.thread_time()
        if self.rows and self.rows[-1]["step"] == report.step:
            self.rows[-1].update(bare_cpu=p1 - p0, bare_main_cpu=m1 - m0)
        self._in_step = 0.0
        self._start = (time.process_time(), time.thread_time())
        self.t_last_hook = time.perf_counter()
        return None


def run(args) -> dict:
    from unittest import mock

    import apr.train.run as run_module
    from apr.apply import run_apply
    from apr.cli.progress import TerminalProgress

    pairing = Pairing(args)
    real_prepare = run_module.prepare_run

    def prepare(*a, **kw):
        r = real_prepare(*a, **kw)
        pairing.attach(r)
        return r

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_data(root / "data", rows=(args.steps + args.warmup + 2) * args.batch, seq=args.seq, vocab=args.vocab)
        cfg = write_config(root, args)
        terminal = TerminalProgress(stream=FakeTTY())
        t0 = time.perf_counter()
        with mock.patch.object(run_module, "prepare_run", prepare):
            result = run_apply(cfg, apr_home=root / "home", echo=terminal.echo, progress=terminal.update,
                               handle_signals=False)
        t_end = time.perf_counter()
        assert result.status == "finished", result.reason
    rows = pairing.rows
    # whole log intervals only: the log step's cost is shared by the interval's steps
    whole = len(rows) - len(rows) % pairing.log_interval if len(rows) >= pairing.log_interval else len(rows)
    rows = rows[:whole] if whole else rows
    bare = statistics.median(r["bare_cpu"] for r in rows)
    host = statistics.fmean(r["host_cpu"] for r in rows)
    background = statistics.fmean(r["background_cpu"] for r in rows)
    paired = [r["loop_cpu"] / r["bare_cpu"] for r in rows]
    per_step_host = sorted(r["host_cpu"] for r in rows)
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
        "python": platform.python_version(), "torch": __import__("torch").__version__,
        "threads": __import__("torch").get_num_threads(),
        "shape": {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq", "batch")},
        "log_interval": pairing.log_interval, "timed_steps": len(rows), "warmup": args.warmup,
        "bare_ms_median": bare * 1e3, "bare_ms_min": min(r["bare_cpu"] for r in rows) * 1e3,
        "bare_ms_max": max(r["bare_cpu"] for r in rows) * 1e3,
        "loop_ms_median": statistics.median(r["loop_cpu"] for r in rows) * 1e3,
        "engine_in_loop_ms_median": statistics.median(r["engine_cpu"] for r in rows) * 1e3,
        "host_ms_mean": host * 1e3, "host_ms_median": statistics.median(per_step_host) * 1e3,
        "host_ms_max": per_step_host[-1] * 1e3, "background_ms_mean": background * 1e3,
        "overhead": (host + background) / bare,
        "paired_ratio_median": statistics.median(paired), "paired_ratio_min": min(paired),
        "paired_ratio_max": max(paired),
        "sum_ratio": sum(r["loop_cpu"] for r in rows) / sum(r["bare_cpu"] for r in rows),
        "startup_s": (pairing.t_first_step or t0) - t0 if pairing.t_first_step else None,
        "finish_s": t_end - (pairing.t_last_hook or t_end),
        "rows": rows,
    }


def render(res: dict) -> str:
    s = res["shape"]
    return "\n".join([
        f"bench_runloop  {res['date']}  {res['machine']}  {res['cpu_count']} CPUs, load {res['loadavg']}  "
        f"python {res['python']}  torch {res['torch']}, {res['threads']} thread(s)",
        f"hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, batch {s['batch']} x seq {s['seq']}, "
        f"fp32; log_interval {res['log_interval']}; {res['warmup']} warm-up + {res['timed_steps']} timed steps",
        "",
        f"bare engine step (CPU, median)      {res['bare_ms_median']:9.1f} ms  "
        f"(min {res['bare_ms_min']:.1f}, max {res['bare_ms_max']:.1f})",
        f"loop iteration (CPU, median)        {res['loop_ms_median']:9.1f} ms  "
        f"(its engine step {res['engine_in_loop_ms_median']:.1f} ms)",
        f"host overhead, main thread, mean    {res['host_ms_mean']:9.3f} ms/step  "
        f"(median {res['host_ms_median']:.3f}, max {res['host_ms_max']:.3f}: the log steps)",
        f"background threads, mean            {res['background_ms_mean']:9.3f} ms/step",
        f"overhead (host + background) / bare {res['overhead'] * 100:9.3f} %",
        f"paired loop/bare, median            {res['paired_ratio_median']:9.4f}  "
        f"(min {res['paired_ratio_min']:.4f}, max {res['paired_ratio_max']:.4f});  "
        f"sum ratio {res['sum_ratio']:.4f}",
        f"fixed costs: plan + build + warm-up {res['startup_s']:.1f} s wall; last step's hook to return "
        f"(final checkpoint, records) {res['finish_s']:.1f} s wall",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 256), ("layers", 6), ("vocab", 8192), ("seq", 256), ("batch", 8),
                          ("steps", 40), ("warmup", 3), ("log_interval", 0)):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(render(res))


if __name__ == "__main__":
    main()
