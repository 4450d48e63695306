"""What bad-step skipping and spike rollback cost a run (docs/performance.md, "Surviving spikes").

Three ways to train the same model on the same pretokenized data, each a whole ``apr train apply``
(records, checkpoints and all) except the baseline:

  off        apr, training.bad_steps and training.rollback off (the default)
  on         apr, bad_steps (loss_z and grad_norm_z) and rollback (threshold 3, never triggered)
             on: one host read of the loss and the norm per step
  baseline   a plain PyTorch loop over the same model and batches (full logits, F.cross_entropy,
             clip_grad_norm_, torch.optim.AdamW), for scale

After one untimed apr run (it builds the data's token cache), runs alternate off/on/baseline
``--repeats`` times (drift on a shared machine hits all alike);
tokens/s is each run's steps x tokens per step over its training wall time (after ``--warmup``
steps), best of the repeats.

    .venv/bin/python benchmarks/bench_survival.py [--hidden 256] [--layers 4] [--seq 128] [--batch 8]
        [--steps 60] [--warmup 5] [--repeats 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write_data(folder: Path, rows: int, seq: int, vocab: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).integers(0, vocab, size=(rows, seq + 1)).astype(np.uint32)
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * (seq + 1))
    pq.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(offsets, pa.array(data.reshape(-1)))}),
                   folder / "shard-00000.parquet")


def config(root: Path, args, name: str, survival: bool) -> Path:
    from apr.plan.examples import to_yaml

    training = {"max_steps": args.steps, "warmup_steps": 0, "lr_scheduler": "constant", "device": args.device,
                "mixed_precision": "fp32" if args.device == "cpu" else "bf16", "output_dir": str(root / name),
                "save_interval": args.steps - 1, "log_interval": 10, "eval_interval": 0}
    if survival:
        training["bad_steps"] = {"loss_z": 50.0, "grad_norm_z": 50.0, "min_history": 2}
        training["rollback"] = {"threshold": 3.0, "min_history": 2, "patience": 3}
    doc = {"model": {"architecture": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                      "num_attention_heads": 4, "num_key_value_heads": 4,
                                      "intermediate_size": args.hidden * 4, "vocab_size": args.vocab,
                                      "max_position_embeddings": args.seq}},
           "data": {"train": str(root / "data"), "batch_size": args.batch, "seq_len": args.seq},
           "optimizer": {"lr": 1e-3}, "training": training,
           "monitoring": {"tracking": {"experiment": "bench-survival"}}}
    path = root / f"{name}.yaml"
    path.write_text(to_yaml(doc))
    return path


def run_apr(cfg: Path, args, home: Path) -> float:
    from apr.apply import run_apply

    times: list[float] = []
    result = run_apply(cfg, apr_home=home, echo=lambda line: None,
                       progress=lambda step, total: times.append(time.perf_counter()))
    assert result.status == "finished", result.reason
    return (len(times) - args.warmup) * args.batch * args.seq / (times[-1] - times[args.warmup - 1])


def run_baseline(args) -> float:
    import torch
    import torch.nn.functional as F

    from apr.config.schema import AprConfig
    from apr.model.llama import build_model

    cfg = AprConfig.model_validate({"model": {"architecture": {
        "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": args.hidden * 4, "vocab_size": args.vocab,
        "max_position_embeddings": args.seq}}, "data": {"train": "x", "batch_size": args.batch, "seq_len": args.seq}})
    model = build_model(cfg.model.architecture, seed=0, device=args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    stamps = []
    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    return (len(stamps) - args.warmup) * args.batch * args.seq / (stamps[-1] - stamps[args.warmup - 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("layers", 4), ("seq", 128), ("batch", 8), ("vocab", 4096),
                          ("steps", 60), ("warmup", 5), ("repeats", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_data(root / "data", rows=args.steps * args.batch, seq=args.seq, vocab=args.vocab)
        run_apr(config(root, args, "untimed", False), args, root / "home")  # the token cache, imports
        for r in range(args.repeats):
            for name in ("off", "on", "baseline"):
                rate = (run_baseline(args) if name == "baseline"
                        else run_apr(config(root, args, f"{name}{r}", name == "on"), args, root / "home"))
                best[name] = max(best.get(name, 0.0), rate)
    print(f"# bench_survival {datetime.date.today()} {platform.node()} {args.device} "
          f"load {os.getloadavg()[0]:.1f}; hidden {args.hidden} layers {args.layers} seq {args.seq} "
          f"batch {args.batch} steps {args.steps}")
    print(f"{'approach':<10} {'tokens/s':>10} {'vs off':>8} {'vs baseline':>12}")
    for name in ("off", "on", "baseline"):
        print(f"{name:<10} {best[name]:>10.0f} {best[name] / best['off']:>8.3f} {best[name] / best['baseline']:>12.3f}")


if __name__ == "__main__":
    main()
