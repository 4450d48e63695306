"""What the teacher output cache (training.distill.cache_teacher_outputs) buys phase 1
(docs/performance.md, "Teacher output cache").

A teacher of --teacher-layers blocks (hidden 128, trained one step on the test corpus so that it is
an apr checkpoint) and a student of --student-layers blocks (each learning teacher-layers /
student-layers teacher blocks). Phase 1 runs in process on the composed engine over a pool of
--rows distinct rows of --seq tokens, batches of --batch rows, --passes passes over the pool per
student block (epochs over a small corpus: the case the cache is for), three ways:

  uncached   the teacher runs its first end_i blocks on every phase-1 step of block i;
  cold       cache_teacher_outputs on a fresh cache: each row runs through the teacher once;
  warm       the same over the cache the cold run left (a rerun or a resume).

Prints phase-1 steps per CPU second (time.process_time: the machine is shared) and the ratios to
the uncached run, and the cache's size on disk. The student's weights after each run are compared
with the uncached run's (bitwise).

    .venv/bin/python benchmarks/bench_teacher_cache.py [--rows 32] [--passes 3]
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from apr.steps.resolved import resolve as plan_of  # noqa: E402
from tests.train.run_helpers import VOCAB, config_doc, make_dataset  # noqa: E402  (the repository on the path first)


def arch(layers: int, seq: int) -> dict:
    return {"hidden_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 384, "vocab_size": VOCAB, "max_position_embeddings": seq}


def phase1(doc: dict, batches: list, blocks: int, per_block: int) -> tuple[float, object]:
    import torch

    from apr.config.schema import AprConfig
    from apr.train.build import build_engine

    engine = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    torch.manual_seed(0)
    start = time.process_time()
    for step in range(1, blocks * per_block + 1):
        engine.current_step = step
        engine.train_step([batches[(step - 1) % len(batches)]], 1e-3)
    return time.process_time() - start, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-layers", type=int, default=8)
    ap.add_argument("--student-layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["APR_HOME"] = str(root / "home")
        make_dataset(root)
        teacher = config_doc(root, model={"architecture": arch(args.teacher_layers, args.seq)},
                             training={"max_steps": 1, "save_interval": 1, "output_dir": "teacher/"})
        (root / "teacher.json").write_text(json.dumps(teacher))
        subprocess.run([sys.executable, str(REPO / "tests/train/run_worker.py"), str(root / "teacher.json")],
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
        per_block = args.passes * args.rows // args.batch
        g = torch.Generator().manual_seed(0)
        pool = torch.randint(0, VOCAB, (args.rows, args.seq + 1), generator=g)
        batches = list(pool.split(args.batch))
        doc = config_doc(root, model={"architecture": arch(args.student_layers, args.seq)},
                         data={"seq_len": args.seq, "batch_size": args.batch},
                         training={"mode": "distill", "engine": "standard", "output_dir": "student/",
                                   "max_steps": args.student_layers * per_block,
                                   "distill": {"teacher": str(root / "teacher"), "phase1_steps": per_block,
                                               "block_loss": "l1"}})
        cached = json.loads(json.dumps(doc))
        cached["training"]["distill"]["cache_teacher_outputs"] = True
        results = {}
        for name, d in (("uncached", doc), ("cold", cached), ("warm", cached)):
            results[name] = phase1(d, batches, args.student_layers, per_block)
        base_s, base = results["uncached"]
        steps = args.student_layers * per_block
        cache = results["cold"][1].loss.cache
        size = sum(f.stat().st_size for f in (cache.data, cache.sums, cache.idx))
    print(f"# bench_teacher_cache {datetime.date.today()} on {platform.machine()} ({os.cpu_count()} CPUs, 1 thread); "
          f"teacher {args.teacher_layers} blocks, student {args.student_layers}, hidden 128, {args.rows} rows of "
          f"{args.seq} tokens, batch {args.batch}, {per_block} phase-1 steps per block ({args.passes} passes)")
    print(f"{'run':<10} {'steps/CPU s':>12} {'x uncached':>11} {'bitwise':>8}")
    for name, (secs, engine) in results.items():
        same = all(torch.equal(engine.model.state_dict()[k], v) for k, v in base.model.state_dict().items())
        print(f"{name:<10} {steps / secs:>12.2f} {base_s / secs:>11.2f} {str(same):>8}")
    print(f"cache on disk: {size:,} bytes ({cache.count} rows x {len(cache.boundaries)} boundaries)")


if __name__ == "__main__":
    main()
