"""What verifying the token cache and fingerprinting the data cost (docs/performance.md, "Token
cache verification and data fingerprints").

1. cache: shards of random ids (--mtokens million tokens, rows of 1,025) -> `ShardLoader` with a
   fresh cache folder (decode + write + block checksums), then a warm open, then one pass reading
   every row in stored order through `iter_sequential` (each 4 MiB block checked on first touch),
   against the same pass over a plain `np.memmap` of the cache file with no check (the baseline:
   what the loader did before verification), and against hashing the whole file at open (the
   alternative the lazy check avoids). Seconds and ratios.
2. fingerprint: `apr.readers.content_digest` of one shard (sampled above 1 MiB) against
   `os.stat` alone (the old size + mtime fingerprint), per file.

    .venv/bin/python benchmarks/bench_tokencache.py [--mtokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtokens", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import numpy as np

    from apr.data import tokencache
    from apr.data.loader import ShardLoader
    from apr.data.shards import write_dataset
    from apr.readers import content_digest

    width = 1025
    rows = int(args.mtokens * 1e6) // width
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ids = np.random.default_rng(0).integers(0, 32768, size=(rows, width), dtype=np.uint32)
        write_dataset(tmp / "d", {"train": ids}, {"seq_len": width - 1}, 4096)
        del ids
        train = tmp / "d" / "train"
        kw = dict(seq_len=width - 1, batch_size=64, shuffle=False)

        t = time.perf_counter()
        ShardLoader(train, cache_dir=tmp / "cache", **kw)
        build = time.perf_counter() - t
        open_warm = best(lambda: ShardLoader(train, cache_dir=tmp / "cache", **kw), args.repeats)
        (data,) = (tmp / "cache").glob("*.u32")
        size = data.stat().st_size

        def verified_pass():
            loader = ShardLoader(train, cache_dir=tmp / "cache", **kw)
            for _ in loader.iter_sequential(keep_tail=True):
                pass
            assert loader._cache.unchecked == 0

        def plain_pass():
            mm = np.memmap(data, dtype="<u4", mode="r", shape=(size // 4 // width, width))
            for start in range(0, len(mm), 64):
                np.asarray(mm[start:start + 64], dtype=np.int64)

        def full_hash():
            with open(data, "rb") as f:
                h = hashlib.blake2b(digest_size=16)
                while chunk := f.read(tokencache.BLOCK_BYTES):
                    h.update(chunk)

        verified = best(verified_pass, args.repeats)
        plain = best(plain_pass, args.repeats)
        hashed = best(full_hash, args.repeats)
        shard = sorted(train.glob("*.parquet"))[0]
        shard_mib = shard.stat().st_size / 2**20
        digest = best(lambda: content_digest(shard), args.repeats * 10)
        stat_only = best(lambda: os.stat(shard), args.repeats * 10)

    print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"cache: {rows:,} rows x {width} tokens = {size / 2**20:.0f} MiB")
    print(f"  build (decode + write + checksums)     {build:8.3f} s")
    print(f"  warm open (no hashing)                 {open_warm * 1e3:8.1f} ms")
    print(f"  one pass, every block checked           {verified:8.3f} s")
    print(f"  baseline: same pass, plain memmap       {plain:8.3f} s   ratio {verified / plain:.2f}x")
    print(f"  alternative: full hash at open          {hashed:8.3f} s   ({size / hashed / 2**30:.2f} GiB/s)")
    print(f"fingerprint of one {shard_mib:.1f} MiB shard: content_digest "
          f"{digest * 1e3:.2f} ms, stat only {stat_only * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
