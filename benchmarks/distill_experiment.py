"""Does blockwise distillation beat training the same student from scratch? (docs/training.md,
"Blockwise distillation"). An experiment, not a benchmark of speed.

On the built-in corpus (the standard library's source, pretokenized like `make demo` does):

  teacher   a 4-block model trained for --teacher-steps steps
  distill   a 2-block student: phase 1 (--phase1 steps per block, each student block learns two
            teacher blocks from the teacher's hidden states), then phase 2 (KD + LM loss) to
            --steps steps in all
  scratch   the same 2-block student from random weights, plain LM loss, --steps steps

Both students see the same number of tokens. Prints each run's validation-loss curve (every
--eval steps) and the final gap to the teacher.

    .venv/bin/python benchmarks/distill_experiment.py [--teacher-steps 300] [--steps 300] [--phase1 50]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def apr(*args: str, cwd: Path, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "apr", *args], cwd=cwd, env=env, check=True,
                   stdout=subprocess.DEVNULL)


def prepare_corpus(work: Path, env: dict) -> None:
    """The stdlib corpus under WORK: a 2,048-token BPE tokenizer and 128-token rows (5% validation)."""
    apr("data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--out",
        str(work / "tokenizer.json"), cwd=work, env=env)
    apr("data", "pretokenize", "--builtin", "stdlib", "--tokenizer", str(work / "tokenizer.json"),
        "--seq-len", "128", "--val-fraction", "0.05", "--seed", "0", "--out", str(work / "data"), cwd=work, env=env)


def config(work: Path, name: str, layers: int, steps: int, eval_every: int, **training) -> Path:
    doc = {
        "model": {"architecture": {"hidden_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 2048,
                                   "max_position_embeddings": 128, "tie_word_embeddings": True}},
        "data": {"train": str(work / "data/train"), "val": str(work / "data/val"), "batch_size": 16,
                 "seq_len": 128, "tokenizer": str(work / "tokenizer.json")},
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4},
        "training": {"max_steps": steps, "epochs": 10, "warmup_steps": 15, "device": "cpu",
                     "output_dir": str(work / name),
                     "save_interval": steps, "log_interval": 50, "eval_interval": eval_every, "eval_batches": 8,
                     "loss_chunk_size": 64, "mixed_precision": "fp32", **training},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def curve(run: Path) -> list[tuple[int, float]]:
    state = json.loads((run / "training_state.json").read_text())
    return [(int(s), float(v)) for s, v in state["val_loss_history"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--phase1", type=int, default=50, help="phase 1 steps per student block")
    ap.add_argument("--eval", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "APR_HOME": str(work / "home")}
        prepare_corpus(work, env)
        runs = {
            "teacher": config(work, "teacher", 4, args.teacher_steps, args.eval),
            "scratch": config(work, "scratch", 2, args.steps, args.eval),
        }
        for name in ("teacher", "scratch"):
            apr("train", "apply", str(runs[name]), cwd=work, env=env)
        runs["distill"] = config(work, "distill", 2, args.steps, args.eval, mode="distill", engine="standard",
                                 distill={"teacher": str(work / "teacher"), "phase1_steps": args.phase1})
        apr("train", "apply", str(runs["distill"]), cwd=work, env=env)
        curves = {name: curve(work / name) for name in ("teacher", "distill", "scratch")}
    print(f"# distill_experiment {datetime.date.today()} on {platform.machine()} {platform.processor() or ''}"
          f" ({os.cpu_count()} CPUs); teacher {args.teacher_steps} steps, students {args.steps} steps "
          f"(distill: phase 1 {args.phase1} steps x 2 blocks)")
    steps = sorted({s for c in curves.values() for s, _ in c})
    print(f"{'step':>6} " + " ".join(f"{n:>9}" for n in curves))
    for s in steps:
        row = [dict(c).get(s) for c in curves.values()]
        print(f"{s:>6} " + " ".join(f"{v:>9.4f}" if v is not None else f"{'':>9}" for v in row))
    final = {n: c[-1][1] for n, c in curves.items()}
    print(f"final val loss: teacher {final['teacher']:.4f}, distilled student {final['distill']:.4f} "
          f"(gap {final['distill'] - final['teacher']:+.4f}), scratch student {final['scratch']:.4f} "
          f"(gap {final['scratch'] - final['teacher']:+.4f})")


if __name__ == "__main__":
    main()
