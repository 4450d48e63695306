"""Does orchestrated training help? (docs/training.md, "Orchestrated training"; the numbers are in
docs/performance.md). An experiment at equal compute, not a benchmark of speed.

On the built-in corpus (the standard library's source, pretokenized like `make demo` does), a small
model (hidden 64, 2 blocks, vocab 2048, batch 8 x 128 tokens), each arm with the same budget of
optimizer steps, branches counted:

  orchestrated  training.orchestrator with the four built-in strategies, K = 2 branches of
                --horizon steps at every --interval steps; its max_steps is what the budget leaves
                after the losers' steps (apr.steps.orchestration.overhead)
  adamw lr=X    fixed AdamW at each learning rate of a small grid (the demo's 3e-3 is the middle)
  default       apr's defaults for the optimizer (lr 3e-4, weight decay 0.1, grad_clip 1.0)

Every arm runs with --seeds seeds (init and data order). Reports the final validation loss (over
--eval-batches batches; the orchestrator scores its branches on the first 8 of them) per arm: mean,
spread, and each seed. In-process (no subprocess per run), on the CPU.

    .venv/bin/python benchmarks/bench_orchestrator.py [--budget 150] [--seeds 3] [--data DIR --tokenizer FILE]
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

REPO = Path(__file__).resolve().parent.parent


def prepare_data(work: Path) -> tuple[Path, Path]:
    env = {**os.environ, "APR_HOME": str(work / "home")}
    run = [sys.executable, "-m", "apr"]
    subprocess.run([*run, "data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--out",
                    str(work / "tokenizer.json")], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*run, "data", "pretokenize", "--builtin", "stdlib", "--tokenizer", str(work / "tokenizer.json"),
                    "--seq-len", "128", "--val-fraction", "0.05", "--seed", "0", "--out", str(work / "data")],
                   cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
    return work / "data", work / "tokenizer.json"


def config_doc(data: Path, tokenizer: Path, out: Path, seed: int, steps: int, args, optimizer: dict,
               orchestrator: dict | None = None) -> dict:
    return {
        "model": {"architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "intermediate_size": 192, "vocab_size": 2048,
                                   "max_position_embeddings": 128, "tie_word_embeddings": True}},
        "data": {"train": str(data / "train"), "val": str(data / "val"), "batch_size": 8, "seq_len": 128,
                 "tokenizer": str(tokenizer)},
        "optimizer": optimizer,
        "training": {"max_steps": steps, "epochs": 10, "warmup_steps": 10, "device": "cpu", "kernels": "torch",
                     "output_dir": str(out), "save_interval": 10_000, "log_interval": 1000,
                     "eval_interval": steps, "eval_batches": args.eval_batches, "loss_chunk_size": 64,
                     "mixed_precision": "fp32", "seed": seed, "checkpoint_async": False,
                     **({"orchestrator": orchestrator} if orchestrator else {})},
        "monitoring": {"tracking": {"experiment": "bench-orchestrator"}},
    }


def orchestrated_steps(args) -> tuple[int, dict]:
    """The orchestrated run's max_steps: the largest whose steps plus the losers' fit the budget."""
    from apr.config.schema import AprConfig
    from apr.steps.orchestration import overhead

    orch = {"enabled": True, "decision_interval": args.interval, "eval_horizon": args.horizon, "branches": 2,
            "eval_batches": 8}
    best = None
    for steps in range(args.budget, 0, -1):
        doc = config_doc(Path("d"), Path("t"), Path("o"), 0, steps, args, {"lr": 3.0e-3}, orch)
        facts = overhead(AprConfig.model_validate(doc), steps)
        if steps + facts["extra_steps"] <= args.budget:
            best = (steps, facts)
            break
    return best[0], {**orch, "_facts": best[1]}


def run_one(doc: dict) -> tuple[float, float, list[str]]:
    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.run import ApplyOptions, prepare_run

    cfg = AprConfig.model_validate(doc)
    lines: list[str] = []
    t0 = time.perf_counter()
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg),
                      config_path=Path(doc["training"]["output_dir"]) / "c.yaml",
                      options=ApplyOptions(echo=lines.append, handle_signals=False))
    result = run.execute()
    history = [d["winner"] for d in run.orchestrator.history] if run.orchestrator is not None else []
    return result.val_loss, time.perf_counter() - t0, history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=150, help="optimizer steps per arm, branches counted")
    ap.add_argument("--interval", type=int, default=30)
    ap.add_argument("--horizon", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--arms", default=None, help="run only these arms (comma-separated names as printed)")
    ap.add_argument("--data", type=Path, default=None, help="a pretokenized folder (train/, val/); default: build one")
    ap.add_argument("--tokenizer", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("APR_CPU_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["APR_HOME"] = str(work / "home")
        data, tokenizer = (args.data, args.tokenizer) if args.data else prepare_data(work)
        steps, orch = orchestrated_steps(args)
        facts = orch.pop("_facts")
        arms = {"orchestrated": (steps, {"lr": 3.0e-3}, orch)}
        for lr in args.lrs.split(","):
            arms[f"adamw lr={lr}"] = (args.budget, {"lr": float(lr)}, None)
        arms["default"] = (args.budget, {}, None)
        if args.arms:
            arms = {name: arm for name, arm in arms.items() if name in args.arms.split(",")}
        print(f"budget {args.budget} optimizer steps per arm; orchestrated: {steps} run steps + "
              f"{facts['extra_steps']} losers' steps ({facts['decisions']} decisions x K=2 x horizon {args.horizon})")
        results: dict[str, list[float]] = {}
        for name, (max_steps, optimizer, orchestrator) in arms.items():
            for seed in range(args.seeds):
                out = work / f"{name.replace(' ', '_')}-{seed}"
                val, seconds, winners = run_one(config_doc(data, tokenizer, out, seed, max_steps, args, optimizer,
                                                           orchestrator))
                results.setdefault(name, []).append(val)
                print(f"  {name:<14} seed {seed}: val loss {val:.4f} ({seconds:.1f} s)"
                      + (f"  winners {', '.join(winners)}" if winners else ""), flush=True)
        print(f"\n{'arm':<14} {'mean val loss':>13} {'sd':>7}  seeds")
        for name, vals in results.items():
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            print(f"{name:<14} {statistics.mean(vals):>13.4f} {sd:>7.4f}  {' '.join(f'{v:.4f}' for v in vals)}")
        fixed = [n for n in results if n.startswith("adamw")]
        if "orchestrated" in results and fixed:
            best_fixed = min(fixed, key=lambda n: statistics.mean(results[n]))
            gap = statistics.mean(results["orchestrated"]) - statistics.mean(results[best_fixed])
            print(f"\norchestrated - best fixed ({best_fixed}): {gap:+.4f} val loss")
        print(f"{datetime.date.today()} {platform.machine()} {platform.processor() or ''} "
              f"python {platform.python_version()}")


if __name__ == "__main__":
    main()
