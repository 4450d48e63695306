"""Upcycling a trained teacher into another attention (docs/training.md, "Blockwise distillation").
An experiment, not a benchmark of speed.

On the built-in corpus (the standard library's source, pretokenized like `make demo` does):

  teacher        4 blocks, 4 heads, 2 KV heads, trained for --teacher-steps steps
  gqa            the same shape with 1 KV head (half), upcycled: phase 1 (l1 block loss, --phase1
                 steps per block), then phase 2 (KD + LM) to --steps steps in all
  dba            decoupled bottleneck attention (sem_dim 8 + geo_dim 8 of head_dim 32), upcycled alike
  *-scratch      the same students from random weights, plain LM loss, --steps steps

Every student sees the same tokens. Prints validation loss after phase 1 and at the end, against
the teacher, and each model's KV-cache bytes per token (float32, apr.model.spec).

    .venv/bin/python benchmarks/upcycle_experiment.py [--teacher-steps 300] [--steps 200] [--phase1 25]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from distill_experiment import apr, prepare_corpus  # noqa: E402  (benchmarks/, the script's folder)

from apr.config.schema import Architecture  # noqa: E402  (the repository on the path first)
from apr.model.spec import kv_cache_bytes_per_token  # noqa: E402

ARCH = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 384, "vocab_size": 2048, "max_position_embeddings": 128, "tie_word_embeddings": True}
STUDENTS = {"gqa": {"num_key_value_heads": 1}, "dba": {"decoupled_attention": {"sem_dim": 8, "geo_dim": 8}}}


def config(work: Path, name: str, arch: dict, steps: int, eval_every: int, **training) -> Path:
    doc = {
        "model": {"architecture": arch},
        "data": {"train": str(work / "data/train"), "val": str(work / "data/val"), "batch_size": 16,
                 "seq_len": 128, "tokenizer": str(work / "tokenizer.json")},
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4},
        "training": {"max_steps": steps, "epochs": 10, "warmup_steps": 15, "device": "cpu",
                     "output_dir": str(work / name), "save_interval": steps, "log_interval": 50,
                     "eval_interval": eval_every, "eval_batches": 8, "loss_chunk_size": 64, "mixed_precision": "fp32",
                     **training},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def curve(run: Path) -> dict[int, float]:
    state = json.loads((run / "training_state.json").read_text())
    return {int(s): float(v) for s, v in state["val_loss_history"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--phase1", type=int, default=25, help="phase 1 steps per student block")
    args = ap.parse_args()
    p1 = 4 * args.phase1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "APR_HOME": str(work / "home")}
        prepare_corpus(work, env)
        apr("train", "apply", str(config(work, "teacher", ARCH, args.teacher_steps, args.teacher_steps)),
            cwd=work, env=env)
        curves, verdicts = {"teacher": curve(work / "teacher")}, {}
        for name, change in STUDENTS.items():
            arch = {**ARCH, **change}
            distill = {"teacher": str(work / "teacher"), "phase1_steps": args.phase1, "block_loss": "l1",
                       "verify": {"batches": 4}}
            apr("train", "apply", str(config(work, name, arch, args.steps, p1, mode="distill", engine="standard",
                                             distill=distill)), cwd=work, env=env)
            apr("train", "apply", str(config(work, f"{name}-scratch", arch, args.steps, p1)), cwd=work, env=env)
            curves[name], curves[f"{name}-scratch"] = curve(work / name), curve(work / f"{name}-scratch")
            verdicts[name] = json.loads((work / name / "verify.json").read_text())
    print(f"# upcycle_experiment {datetime.date.today()} on {platform.machine()} ({os.cpu_count()} CPUs); teacher "
          f"{args.teacher_steps} steps; students {args.steps} steps (upcycled: phase 1 {args.phase1} x 4 blocks = "
          f"{p1} steps, l1)")
    teacher = curves["teacher"][args.teacher_steps]
    print(f"{'model':<12} {'KV B/token':>10} {'val@0':>8} {'val@' + str(p1):>8} {'val@' + str(args.steps):>9} "
          f"{'vs teacher':>10}")
    for name, c in curves.items():
        arch = Architecture(**{**ARCH, **STUDENTS.get(name.removesuffix("-scratch"), {})})
        end = c[max(c)]
        print(f"{name:<12} {kv_cache_bytes_per_token(arch, 4):>10} {c.get(0, float('nan')):>8.4f} "
              f"{c.get(p1, float('nan')):>8.4f} {end:>9.4f} {end - teacher:>+10.4f}")
    for name, v in verdicts.items():
        rows = ", ".join(f"{r['what']} {r['mean_l1']:.3g}/{r['max_l1']:.3g}" for r in v["rows"])
        print(f"verify {name}: {'ok' if v['ok'] else 'outside a threshold'}: mean/max L1 {rows}")


if __name__ == "__main__":
    main()
