"""Stage 2 of a progressively stacked run with and without cached trunk activations
(`model.stacking.cache_activations`, docs/performance.md, "Cached trunk activations").

Both runs are apr (`prepare_run` in this process) on the same data and config, the baseline with
the cache off: stage 0 trains the bottom half of the blocks, stage 1 freezes them and the embedding
(`earlier: freeze`, `freeze_embedding: true`) and trains the top half for several epochs over a
small dataset, so that every row is read again. Each optimizer step of stage 1 is timed (the
engine's `train_step`); the first epoch of stage 1 fills the cache (its steps compute the trunk
and write it), the later epochs read it.

Reported: tokens/s of stage 1 (all its steps, and the steps after its first epoch) for each run,
their ratio, and whether the final weights are bitwise equal.

    .venv/bin/python benchmarks/bench_trunk_cache.py [--hidden 256] [--layers 8] [--seq 128] [--batch 8]
        [--rows 64] [--epochs 4] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from apr.plan.build import resolve_config  # noqa: E402


def write_rows(folder: Path, rows: int, seq: int, vocab: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).integers(0, vocab, size=(rows, seq + 1)).astype(np.uint32)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * (seq + 1))
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(data.reshape(-1)))}),
                   folder / "shard-00000.parquet")


def run(root: Path, args, cache: bool) -> dict:
    from safetensors.torch import load_file

    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.engine import Engine
    from apr.train.run import ApplyOptions, prepare_run

    steps_per_epoch = args.rows // args.batch
    stage0 = steps_per_epoch  # one epoch at half depth
    doc = {
        "model": {"architecture": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                   "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 64,
                                   "intermediate_size": args.hidden * 4, "vocab_size": 4096,
                                   "max_position_embeddings": args.seq},
                  "stacking": {"stages": [{"blocks": args.layers // 2, "steps": stage0}, {"blocks": args.layers}],
                               "earlier": "freeze", "freeze_embedding": True, "cache_activations": cache}},
        "data": {"train": str(root.parent / "data"), "batch_size": args.batch, "seq_len": args.seq},
        "optimizer": {"lr": 3e-4},
        "training": {"epochs": args.epochs, "mixed_precision": "fp32", "device": "cpu", "kernels": "torch",
                     "output_dir": str(root), "save_interval": 100000, "eval_interval": 0, "log_interval": 1000,
                     "seed": 7},
        "monitoring": {"tracking": {"experiment": "bench-trunk-cache"}},
    }
    config = AprConfig.model_validate(doc)
    times: list[tuple[int, float]] = []
    step = Engine.train_step

    def timed(self, micro_batches, lr):
        t = time.perf_counter()
        out = step(self, micro_batches, lr)
        times.append((self.current_step, time.perf_counter() - t))
        return out

    Engine.train_step = timed
    try:
        r = prepare_run(resolve_config(config), config_hash=config_hash(config), config_path=root / "cfg.yaml",
                        options=ApplyOptions(echo=lambda line: None, handle_signals=False))
        result = r.execute()
    finally:
        Engine.train_step = step
    tokens = args.batch * args.seq
    stage1 = [dt for s, dt in times if s > stage0]
    later = [dt for s, dt in times if s > stage0 + steps_per_epoch]
    final = load_file(str(root / f"checkpoint-step-{result.final_step}.safetensors"))
    cache_obj = r.engine.trunk_cache
    return {"stage1_tokens_per_s": tokens * len(stage1) / sum(stage1),
            "later_tokens_per_s": tokens * len(later) / sum(later) if later else None,
            "steps": len(stage1), "hits": cache_obj.hits if cache_obj else 0,
            "misses": cache_obj.misses if cache_obj else 0, "weights": final}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_rows(tmp / "data", args.rows, args.seq, 4096)
        base = run(tmp / "uncached", args, cache=False)
        cached = run(tmp / "cached", args, cache=True)
    same = set(base["weights"]) == set(cached["weights"]) and all(
        cached["weights"][k].equal(v) for k, v in base["weights"].items())
    out = {"config": vars(args), "threads": torch.get_num_threads(),
           "uncached": {k: v for k, v in base.items() if k != "weights"},
           "cached": {k: v for k, v in cached.items() if k != "weights"},
           "ratio_stage1": cached["stage1_tokens_per_s"] / base["stage1_tokens_per_s"],
           "ratio_later": (cached["later_tokens_per_s"] / base["later_tokens_per_s"]
                           if base["later_tokens_per_s"] else None),
           "weights_bitwise_equal": same}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name in ("uncached", "cached"):
            r = out[name]
            print(f"{name:9s} stage 1: {r['stage1_tokens_per_s']:,.0f} tokens/s over {r['steps']} steps; after its "
                  f"first epoch {r['later_tokens_per_s']:,.0f} tokens/s (cache hits {r['hits']}, misses {r['misses']})")
        print(f"ratio cached / uncached: stage 1 {out['ratio_stage1']:.2f}x, after the first epoch "
              f"{out['ratio_later']:.2f}x; final weights bitwise equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
