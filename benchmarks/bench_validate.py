"""Cold-process time of `apr train validate` (docs/performance.md, "apr train validate").

Runs `python -m apr train validate CONFIG` --repeat times, each a fresh interpreter, and prints the
min / median / max wall time and the median CPU time (user + system) of the process, with the load
average before and after: on a shared machine the wall time follows the load, the CPU time much
less. Bytecode caches are written by a warm-up run (an installed apr has them; without them every
module is compiled at each start). With --baseline DIR (a checkout of another commit, e.g.
`git archive REV | tar -x -C DIR`) the two trees run alternately, so that both see the same load.

    .venv/bin/python benchmarks/bench_validate.py [--repeat 10] [--config PATH] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = Path("configs/train/pretrain-350m-v2.yaml")  # relative: each tree validates its own copy


def one_run(tree: Path, config: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, exit code) of one validate in a fresh process importing ``tree``
    (run from ``tree``: `python -m` puts the current folder first on sys.path)."""
    env = dict(os.environ, PYTHONPATH=str(tree), NO_COLOR="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: the warm-up run writes the bytecode caches
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "apr", "train", "validate", str(config)], env=env, cwd=tree,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def summary(name: str, runs: list[tuple[float, float, int]]) -> str:
    walls = [w for w, _, _ in runs]
    cpus = [c for _, c, _ in runs]
    codes = sorted({code for _, _, code in runs})
    return (f"{name:<10} wall min {min(walls):.3f} s  median {statistics.median(walls):.3f} s  max {max(walls):.3f} s"
            f" | cpu median {statistics.median(cpus):.3f} s | exit {codes}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to time alternately")
    args = ap.parse_args()
    trees = {"this tree": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    print(f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.2f}")
    for tree in trees.values():  # warm the page cache and the bytecode caches
        one_run(tree, args.config)
    runs: dict[str, list] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            runs[name].append(one_run(tree, args.config))
    for name in trees:
        print(summary(name, runs[name]))
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
