"""Speed of the data path (docs/performance.md, "Data: pretokenizing and the loader").

1. pretokenize: `apr.data.pretokenize.pretokenize` end to end (read .txt files, encode, pack,
   split, write zstd Parquet shards and the manifest) on plain-text files made from the standard
   library's source, against a plain single-threaded loop of `tokenizer.encode(doc)` over the
   same documents already in memory (encoding only: no reading, packing or writing). Tokens/s
   of both and their ratio. Best of --repeats.
2. loader: `ShardLoader.next_batch()` for batch 4 x seq 1024 (the 350M config) over shards of
   random ids < 32768, against a plain baseline that holds the same shards as one pyarrow table
   and builds each batch with `take` + `to_pylist` + `numpy.array(dtype=int64)` +
   `torch.from_numpy`. ms per batch (mean and p99) and the ratio; the target is 20x faster than
   the reference's 525 ms/step, i.e. under 26 ms per batch. Also the loader's open time, cold
   (decoding the shards into the token cache) and warm (memory-mapping the cache).

    .venv/bin/python benchmarks/bench_data.py [--mbytes 8] [--vocab 32768] [--repeats 3] [--batches 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def bench_pretokenize(tmp: Path, mbytes: float, vocab: int, repeats: int) -> dict:
    import numpy as np

    from apr.data.corpus import builtin_corpus_files
    from apr.data.pretokenize import pretokenize
    from apr.data.tokenizer import EOT, load_tokenizer, train_tokenizer

    files = builtin_corpus_files("stdlib", int(mbytes * 1e6))
    corpus = tmp / "corpus"
    corpus.mkdir()
    docs = []
    for i, f in enumerate(files):  # plain .txt inputs, one document per file
        text = f.read_text(encoding="utf-8")
        (corpus / f"{i:05d}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    t0 = time.perf_counter()
    train_tokenizer(docs, vocab, tmp / "tokenizer.json")
    train_s = time.perf_counter() - t0

    apr_runs = []
    for r in range(repeats):
        out = tmp / f"shards-{r}"
        t0 = time.perf_counter()
        manifest = pretokenize([corpus], tmp / "tokenizer.json", 1024, out, val_fraction=0.01)
        apr_runs.append(time.perf_counter() - t0)
        shutil.rmtree(out)
    tokens = manifest["tokens_total"]

    tok = load_tokenizer(tmp / "tokenizer.json")
    eot = tok.token_to_id(EOT)
    base_runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids: list[int] = []
        for doc in docs:
            ids.extend(tok.encode(doc).ids)
            ids.append(eot)
        np.array(ids, dtype=np.uint32)
        base_runs.append(time.perf_counter() - t0)
    assert len(ids) == tokens, (len(ids), tokens)
    apr_tps, base_tps = tokens / min(apr_runs), tokens / min(base_runs)
    return {"files": len(files), "mbytes": sum(len(d.encode()) for d in docs) / 1e6, "tokens": tokens,
            "vocab": vocab, "tokenizer_train_s": train_s, "apr_s": min(apr_runs), "baseline_s": min(base_runs),
            "apr_tokens_per_s": apr_tps, "baseline_tokens_per_s": base_tps, "ratio": apr_tps / base_tps}


def bench_loader(tmp: Path, batches: int, rows: int = 8192, batch: int = 4, seq: int = 1024) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from apr.data.loader import ShardLoader
    from apr.data.shards import shard_files
    from apr.data.testing import make_shards

    make_shards(tmp / "ds", rows, seq, 32768, rows_per_shard=2048)
    path = tmp / "ds" / "train"
    cache = tmp / "cache"
    t0 = time.perf_counter()
    ShardLoader(path, seq_len=seq, batch_size=batch, seed=0, cache_dir=cache)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loader = ShardLoader(path, seq_len=seq, batch_size=batch, seed=0, cache_dir=cache)
    warm_s = time.perf_counter() - t0

    def timed(step) -> list[float]:
        out = []
        for _ in range(batches):
            t = time.perf_counter()
            step()
            out.append(time.perf_counter() - t)
        return out

    apr_t = timed(loader.next_batch)

    table = pa.concat_tables([pq.read_table(f) for f in shard_files(path)])
    column = table.column("input_ids")
    rng = np.random.default_rng(0)

    def baseline():
        idx = rng.integers(0, table.num_rows, size=batch)
        return torch.from_numpy(np.array(column.take(pa.array(idx)).to_pylist(), dtype=np.int64))

    assert tuple(baseline().shape) == tuple(loader.next_batch().shape) == (batch, seq + 1)
    base_t = timed(baseline)

    def summary(ts):
        ts = sorted(ts)
        return statistics.fmean(ts) * 1e3, ts[int(len(ts) * 0.99) - 1] * 1e3

    (apr_mean, apr_p99), (base_mean, base_p99) = summary(apr_t), summary(base_t)
    return {"rows": rows, "batch": batch, "seq_len": seq, "batches": batches, "open_cold_s": cold_s,
            "open_warm_s": warm_s, "apr_ms": apr_mean, "apr_p99_ms": apr_p99, "baseline_ms": base_mean,
            "baseline_p99_ms": base_p99, "ratio": base_mean / apr_mean, "vs_525ms": 525 / apr_mean}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbytes", type=float, default=8.0, help="Size of the plain-text corpus (MB).")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--skip-pretokenize", action="store_true")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as d:
        os.environ["APR_HOME"] = str(Path(d) / "home")
        if not args.skip_pretokenize:
            p = bench_pretokenize(Path(d), args.mbytes, args.vocab, args.repeats)
            print(f"pretokenize: {p['files']} .txt files, {p['mbytes']:.1f} MB, {p['tokens']:,} tokens, vocab "
                  f"{p['vocab']} (tokenizer trained in {p['tokenizer_train_s']:.1f} s)")
            print(f"  apr pretokenize (read+encode+pack+write): {p['apr_s']:.2f} s = "
                  f"{p['apr_tokens_per_s'] / 1e6:.2f}M tokens/s")
            print(f"  baseline encode() loop (encode only):      {p['baseline_s']:.2f} s = "
                  f"{p['baseline_tokens_per_s'] / 1e6:.2f}M tokens/s")
            print(f"  ratio: {p['ratio']:.2f}x")
        ld = bench_loader(Path(d) / "loader", args.batches)
        print(f"loader: batch {ld['batch']} x seq {ld['seq_len']}, {ld['rows']:,} rows in 4 shards, "
              f"{ld['batches']} batches")
        print(f"  open: {ld['open_cold_s'] * 1e3:.0f} ms cold (decode into the token cache), "
              f"{ld['open_warm_s'] * 1e3:.1f} ms warm (memory-map)")
        print(f"  ShardLoader.next_batch:                   {ld['apr_ms']:.3f} ms/batch (p99 {ld['apr_p99_ms']:.3f})")
        print(f"  baseline pyarrow take+to_pylist+numpy:    {ld['baseline_ms']:.3f} ms/batch "
              f"(p99 {ld['baseline_p99_ms']:.3f})")
        print(f"  ratio: {ld['ratio']:.0f}x faster than the baseline; {ld['vs_525ms']:,.0f}x faster than the "
              f"reference's 525 ms/step (target >= 20x)")


if __name__ == "__main__":
    main()
