"""Two versions of apr's engine in one process, step for step: is a refactor free?

Usage (a git worktree of the older commit beside this checkout):

    git worktree add --detach /tmp/apr-before fe8be6f
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_engine_ab.py --before /tmp/apr-before \
        [--after .] [--approaches auto,lean/recompute+global,standard] [--steps 12] [--warmup 2]

Each tree's ``apr`` is imported in turn (the first one's modules are dropped from ``sys.modules``
once its engines are built; the engines keep their own module objects alive), and every approach
is built from the same config, seed and batches in both. The timed steps then run round-robin,
one step of each (tree, approach) per round, so both versions see the same machine at the same
moments: the ratio of their CPU time per step is free of the drift that separate runs suffer
(docs/performance.md, "Before and after composing the engine"). The losses are compared too: a
structural change must leave them bitwise equal. The model shape is bench_engine.py's.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_engine  # noqa: E402  (the shapes, settings and config of the engine benchmark)


def _drop_apr() -> None:
    for name in [m for m in sys.modules if m == "apr" or m.startswith("apr.")]:
        del sys.modules[name]


def _build(tree: Path, args, names: list[str]) -> dict:
    """This tree's engines for ``names`` (its own build_engine and execution policy)."""
    _drop_apr()
    sys.path.insert(0, str(tree))
    try:
        apr = importlib.import_module("apr")
        assert Path(apr.__file__).resolve().is_relative_to(tree.resolve()), apr.__file__
        try:
            build_engine = importlib.import_module("apr.train.build").build_engine
        except ModuleNotFoundError:  # before the composed engine: the builder lived in engine.py
            build_engine = importlib.import_module("apr.train.engine").build_engine
        choose = importlib.import_module("apr.plan.memory").choose_execution
        resolve = importlib.import_module("apr.steps.resolved").resolve  # this tree's Resolved class
        engines = {}
        for name in names:
            kind, clip, execution = bench_engine.SETTINGS[name]
            config = bench_engine.make_config(args, engine=kind, clip_mode=clip, execution=execution)
            chosen = choose(config, 64 * 2**30, "bench").execution
            engines[name] = build_engine(resolve(config, execution=chosen), torch.device("cpu"))
        return engines
    finally:
        sys.path.remove(str(tree))
        _drop_apr()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the older tree (a git worktree)")
    ap.add_argument("--after", type=Path, default=HERE.parent, help="the newer tree (default: this checkout)")
    ap.add_argument("--approaches", type=lambda s: s.split(","), default=["auto", "lean/recompute+global", "standard"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    for flag, default in (("--hidden", 256), ("--layers", 6), ("--heads", 4), ("--kv-heads", 4),
                          ("--intermediate", 1024), ("--vocab", 8192), ("--seq", 256), ("--batch", 8),
                          ("--loss-chunk", 256)):
        ap.add_argument(flag, type=int, default=default)
    args = ap.parse_args()
    args.device, args.precision, args.kernels, args.tied = "cpu", None, "torch", False
    torch.set_num_threads(args.threads)
    trees = {"before": args.before, "after": args.after}
    engines = {label: _build(tree, args, args.approaches) for label, tree in trees.items()}
    gen = torch.Generator().manual_seed(bench_engine.SEED)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
               for _ in range(args.warmup + args.steps)]
    cpu = {(label, n): [] for label in trees for n in args.approaches}
    losses = {(label, n): [] for label in trees for n in args.approaches}
    for i, batch in enumerate(batches):
        for n in args.approaches:
            for label in (("before", "after") if i % 2 == 0 else ("after", "before")):  # alternate who goes first
                c0 = time.process_time()
                loss = engines[label][n].train_step([batch], bench_engine.LR).loss
                spent = time.process_time() - c0
                losses[(label, n)].append(float(loss))
                if i >= args.warmup:
                    cpu[(label, n)].append(spent)
    print(f"{args.steps} timed steps per side (CPU time, {args.threads} thread(s)), round-robin in one process")
    print(f"{'approach':<26} {'before ms':>10} {'after ms':>10} {'after/before':>13} {'paired median':>14} "
          f"{'losses':>8}")
    for n in args.approaches:
        b, a = cpu[("before", n)], cpu[("after", n)]
        paired = statistics.median(x / y for x, y in zip(a, b, strict=True))
        same = "equal" if losses[("before", n)] == losses[("after", n)] else "DIFFER"
        print(f"{n:<26} {statistics.median(b) * 1e3:>10.1f} {statistics.median(a) * 1e3:>10.1f} "
              f"{statistics.median(a) / statistics.median(b):>13.3f} {paired:>14.3f} {same:>8}")


if __name__ == "__main__":
    main()
