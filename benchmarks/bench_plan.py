"""Cold-process wall time of `apr train plan` and `apr train validate` (docs/performance.md, "Config
validation and plan").

Prepares, once, what configs/train/pretrain-350m-v2.yaml points at, under --work (relative paths
resolve from there, as in a training repo):

- data/pretokenized-2048-v2/train/: --rows rows of seq_len + 1 = 1025 token ids in shards of
  --shard-rows rows, written by apr.data (zstd, statistics), 67,977 rows like the reference's v2 set;
- data/pretokenized-2048/val/: 2,048 rows;
- models/albor-tokenizer-v2/tokenizer.json: a byte-level BPE with 32,768 tokens trained by
  apr.data.tokenizer on the Python standard library's source.

Then runs each command --repeat times as a fresh process (`python -m apr ...`, the console entry)
and prints min / median / max wall time, plus the plan's last line. The page cache is warm (the
files were just written or read); "cold" means a new interpreter with nothing imported.

    .venv/bin/python benchmarks/bench_plan.py [--work /tmp/apr-bench-plan] [--repeat 7] [--rows 67977]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "train" / "pretrain-350m-v2.yaml"


def prepare(work: Path, rows: int, shard_rows: int) -> None:
    from apr.data.testing import make_shards

    train = work / "data" / "pretokenized-2048-v2"
    if not (train / "manifest.json").exists():
        t = time.perf_counter()
        make_shards(train, n_rows=rows, seq_len=1024, vocab_size=32_768, rows_per_shard=shard_rows)
        print(f"wrote {rows:,} train rows in {time.perf_counter() - t:.1f} s")
    val = work / "data" / "pretokenized-2048"
    if not (val / "manifest.json").exists():
        make_shards(val, n_rows=0, val_rows=2048, seq_len=1024, vocab_size=32_768, seed=1, rows_per_shard=shard_rows)
    tok = work / "models" / "albor-tokenizer-v2" / "tokenizer.json"
    if not tok.exists():
        from apr.data.corpus import builtin_corpus_files
        from apr.data.tokenizer import train_tokenizer

        t = time.perf_counter()
        docs = (p.read_text(encoding="utf-8", errors="replace") for p in builtin_corpus_files("stdlib", max_bytes=None))
        info = train_tokenizer(docs, 32_768, tok)
        print(f"trained a {info['vocab_size']:,}-token BPE in {time.perf_counter() - t:.1f} s")


def timed(args: list[str], cwd: Path, repeat: int) -> tuple[list[float], subprocess.CompletedProcess]:
    env = dict(os.environ, NO_COLOR="1")
    times, last = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        last = subprocess.run([sys.executable, "-m", "apr", *args], cwd=cwd, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t)
    return times, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/apr-bench-plan"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rows", type=int, default=67_977)
    ap.add_argument("--shard-rows", type=int, default=4096)
    ap.add_argument("--gpu", default="4090")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    prepare(a.work, a.rows, a.shard_rows)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, "
          f"Python {platform.python_version()}")
    print(f"config: {CONFIG.relative_to(REPO)} (cwd {a.work})")
    cases = [
        ("plan (text)", ["train", "plan", str(CONFIG), "--gpu", a.gpu]),
        ("plan --json", ["train", "plan", str(CONFIG), "--gpu", a.gpu, "--json"]),
        ("validate", ["train", "validate", str(CONFIG)]),
    ]
    for name, args in cases:
        times, last = timed(args, a.work, a.repeat)
        tail = (last.stdout.strip().splitlines() or [""])[-1] if "--json" not in args else "(json)"
        print(f"{name:<12} min {min(times):.3f} s  median {statistics.median(times):.3f} s  "
              f"max {max(times):.3f} s  (n={len(times)}, exit {last.returncode})  {tail}")
        if last.returncode not in (0, 1):
            print(last.stderr, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
