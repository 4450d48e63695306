"""Does a mixture of experts beat the dense model of equal active parameters at equal steps?
(docs/moe.md; the numbers are in docs/performance.md). An experiment at equal compute per token,
not a benchmark of speed.

On the demo's corpus (the Python standard library's source, its own BPE tokenizer of 2048 tokens,
seq 128, as `make demo` builds it), two arms train the same small decoder (hidden 64, 2 blocks,
batch 8 x 128 tokens, AdamW lr 3e-3, the same steps and data order per seed) on autograd:

  dense   a SwiGLU MLP of width --dense-intermediate (192) per block
  moe     --experts experts (8) of width dense-intermediate / top-k each, --top-k (2) per token:
          the same expert parameters per token (the router's hidden x experts more), and
          --experts / top-k times the MLP parameters in all

Every arm runs with --seeds seeds (init and data order) through apr's own run loop (in process, on
the CPU); prints each run's validation loss (over --eval-batches batches), the means, and the ratio
moe / dense of the mean validation losses, with the parameter counts the plan gives.

    .venv/bin/python benchmarks/bench_moe.py [--steps 600] [--seeds 2] [--experts 8] [--data DIR --tokenizer FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from apr.plan.build import resolve_config


def prepare_data(work: Path) -> tuple[Path, Path]:
    env = {**os.environ, "APR_HOME": str(work / "home")}
    run = [sys.executable, "-m", "apr"]
    subprocess.run([*run, "data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--out",
                    str(work / "tokenizer.json")], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*run, "data", "pretokenize", "--builtin", "stdlib", "--tokenizer", str(work / "tokenizer.json"),
                    "--seq-len", "128", "--val-fraction", "0.05", "--seed", "0", "--out", str(work / "data")],
                   cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
    return work / "data", work / "tokenizer.json"


def config_doc(data: Path, tokenizer: Path, out: Path, seed: int, args, moe: dict | None) -> dict:
    return {
        "model": {"architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "intermediate_size": args.dense_intermediate,
                                   "vocab_size": 2048, "max_position_embeddings": 128, "tie_word_embeddings": True,
                                   **({"moe": moe} if moe else {})}},
        "data": {"train": str(data / "train"), "val": str(data / "val"), "batch_size": 8, "seq_len": 128,
                 "tokenizer": str(tokenizer)},
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "weight_decay": 0.1},
        "training": {"engine": "standard", "max_steps": args.steps, "epochs": 10, "warmup_steps": 15,
                     "device": "cpu", "kernels": "torch", "output_dir": str(out), "save_interval": 100_000,
                     "log_interval": 1000, "eval_interval": args.steps, "eval_batches": args.eval_batches,
                     "loss_chunk_size": 64, "mixed_precision": "fp32", "seed": seed, "checkpoint_async": False},
        "monitoring": {"tracking": {"experiment": "bench-moe"}},
    }


def run_one(doc: dict) -> tuple[float, float, dict]:
    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.plan.configfacts import model_facts
    from apr.train.run import ApplyOptions, prepare_run

    cfg = AprConfig.model_validate(doc)
    lines: list[str] = []
    t0 = time.perf_counter()
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg),
                      config_path=Path(doc["training"]["output_dir"]) / "c.yaml",
                      options=ApplyOptions(echo=lines.append, handle_signals=False))
    result = run.execute()
    return result.val_loss, time.perf_counter() - t0, model_facts(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--dense-intermediate", type=int, default=192)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--balance-coef", type=float, default=0.01)
    ap.add_argument("--data", type=Path, default=None, help="a pretokenized folder (train/, val/); default: build one")
    ap.add_argument("--tokenizer", type=Path, default=None)
    args = ap.parse_args()
    if args.dense_intermediate % args.top_k:
        ap.error("--dense-intermediate must be a multiple of --top-k (equal active parameters)")
    os.environ.setdefault("APR_CPU_THREADS", "1")
    moe = {"num_experts": args.experts, "top_k": args.top_k, "balance_loss_coef": args.balance_coef,
           "expert_intermediate_size": args.dense_intermediate // args.top_k}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["APR_HOME"] = str(work / "home")
        data, tokenizer = (args.data, args.tokenizer) if args.data else prepare_data(work)
        results: dict[str, list[float]] = {}
        facts: dict[str, dict] = {}
        for name, arm in (("dense", None), ("moe", moe)):
            for seed in range(args.seeds):
                val, seconds, facts[name] = run_one(config_doc(data, tokenizer, work / f"{name}-{seed}", seed, args,
                                                               arm))
                results.setdefault(name, []).append(val)
                print(f"  {name:<6} seed {seed}: val loss {val:.4f} ({seconds:.1f} s)", flush=True)
        dense_active = facts["dense"]["params"]
        moe_active = facts["moe"]["moe"]["active_params"]
        print(f"\ndense: {dense_active:,} parameters; moe: {facts['moe']['params']:,} parameters, {moe_active:,} "
              f"active per token ({args.experts} experts of {moe['expert_intermediate_size']}, top {args.top_k}); "
              f"{args.steps} steps of 8 x 128 tokens")
        print(f"{'arm':<6} {'mean val loss':>13} {'sd':>7}  seeds")
        for name, vals in results.items():
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            print(f"{name:<6} {statistics.mean(vals):>13.4f} {sd:>7.4f}  {' '.join(f'{v:.4f}' for v in vals)}")
        ratio = statistics.mean(results["moe"]) / statistics.mean(results["dense"])
        print(f"\nval loss moe / dense: {ratio:.4f}")
        print(f"{datetime.date.today()} {platform.machine()} {platform.processor() or ''} "
              f"python {platform.python_version()}")


if __name__ == "__main__":
    main()
