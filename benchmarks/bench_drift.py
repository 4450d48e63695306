"""Time of the plan's data drift check on a 100M-token dataset (docs/performance.md, "Data drift").

Writes (once, then reuses) a train and a val folder of pretokenized-shaped Parquet shards: rows of
1,025 uint32 tokens, Zipf-distributed ids over a 32,768 vocabulary, 100M tokens of train in 20
shards of 5 row groups and 10M of val; then times ``apr.data.drift`` as the plan runs it: sample
``--sample-tokens`` tokens of whole rows from random row groups of each side (4x the rows wanted, at
most 32 groups), then PSI,
KS and Wasserstein on token ranks and document lengths.

    .venv/bin/python benchmarks/bench_drift.py [--dir /tmp/bench_drift] [--sample-tokens 250000] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from apr.data.drift import dataset_drift, sample_rows

VOCAB, ROW, EOT = 32_768, 1_025, 0


def write(folder: Path, tokens: int, shards: int, seed: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rows_per_shard = tokens // ROW // shards
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(shards):
        path = folder / f"shard-{i:05d}.parquet"
        if not path.exists():
            ids = np.minimum(rng.zipf(1.2, size=rows_per_shard * ROW), VOCAB - 1).astype(np.uint32)
            ids[rng.random(ids.size) < 1 / 400] = EOT  # documents of ~400 tokens
            offsets = np.arange(0, ids.size + 1, ROW, dtype=np.int32)
            col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
            pq.write_table(pa.table({"input_ids": col}), path, row_group_size=max(1, rows_per_shard // 5))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/bench_drift")
    ap.add_argument("--sample-tokens", type=int, default=250_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(args.dir)
    train = write(root / "train", 100_000_000, 20, seed=0)
    val = write(root / "val", 10_000_000, 2, seed=1)
    t0 = time.perf_counter()
    ref = sample_rows(train, "input_ids", args.sample_tokens, seed=0)
    cur = sample_rows(val, "input_ids", args.sample_tokens, seed=1000)
    t1 = time.perf_counter()
    stats = dataset_drift(ref, cur, VOCAB, EOT)
    t2 = time.perf_counter()
    doc = {"train_tokens": sum(pq.read_metadata(p).num_rows for p in train) * ROW,
           "sampled_tokens": [int(ref.size), int(cur.size)], "sample_s": round(t1 - t0, 3),
           "statistics_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3), "stats": [s.to_dict() for s in stats]}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{doc['train_tokens'] / 1e6:.0f}M train tokens; sampled {ref.size:,} + {cur.size:,} tokens in "
          f"{doc['sample_s']} s, statistics in {doc['statistics_s']} s, total {doc['total_s']} s")
    for s in stats:
        print(f"  {s.feature}: PSI {s.psi:.4f}  KS {s.ks:.4f}  Wasserstein {s.wasserstein:.4g}")


if __name__ == "__main__":
    main()
