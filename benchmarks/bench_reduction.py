"""The cost of ``training.reduction: canonical`` against ``fast`` on 2 gloo ranks of this CPU
(docs/performance.md, "Canonical reduction").

Each rank builds both engines (autograd, or the walk with ``--engine interleaved``; accumulation
--accum) from the same config, seed and batches, then times their steps round-robin (fast,
canonical, fast, ...) so both see the same machine; per step it reports rank 0's median wall time,
and the bytes canonical holds beyond fast at its peak (``apr.plan.reductionfacts.reduction_cost``).
It also compares the two losses over the global batch (fast's per-rank means averaged over the
ranks; canonical's is already global): equal within float rounding.

``--sharding full`` (or hybrid, shard_grad_op) times both on FSDP2 shards (canonical: no reduce-scatter,
an all-to-all of the micro-batches' shard rows and an all-gather of the mean gradient for the norms).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_reduction.py [--ranks 2] [--accum 2] [--steps 8] \
        [--sharding none] [--engine standard]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _config(args, reduction: str):
    from apr.config.schema import AprConfig

    return AprConfig.model_validate({
        "model": {"architecture": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                   "num_attention_heads": 4, "num_key_value_heads": 4,
                                   "intermediate_size": 4 * args.hidden, "vocab_size": args.vocab,
                                   "max_position_embeddings": args.seq}},
        "data": {"train": "unused/", "batch_size": args.batch, "seq_len": args.seq},
        "training": {"engine": args.engine, "reduction": reduction, "gradient_accumulation": args.accum,
                     "world_size": args.ranks, "kernels": "torch", "device": "cpu", "seed": 0,
                     "sharding": args.sharding, "nodes": 2 if args.sharding == "hybrid" else 1},
    })


def _rank(rank: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(1)
    from apr.model.spec import trainable_param_count
    from apr.plan.reductionfacts import reduction_cost
    from apr.steps.resolved import resolve
    from apr.train.build import build_engine
    from apr.train.dist import DataParallel

    dp = DataParallel(rank=rank, world_size=args.ranks, local_rank=rank, backend="gloo")
    engines = {}
    for mode in ("fast", "canonical"):
        config = _config(args, mode)
        torch.manual_seed(0)
        engines[mode] = (build_engine(resolve(config), torch.device("cpu"), dp=dp), config)
    g = torch.Generator().manual_seed(100 + rank)
    data = [[torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.accum)]
            for _ in range(args.steps + args.warmup)]
    times = {m: [] for m in engines}
    losses = {m: [] for m in engines}
    for k, micro in enumerate(data):
        for mode, (engine, _) in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            result = engine.train_step(micro, lr=1e-3)
            loss_t = result.loss.detach().clone().reshape(1)
            if mode == "fast":  # each rank's own mean: averaged over the ranks, the global batch's
                dist.all_reduce(loss_t)
                loss_t /= args.ranks
            loss = float(loss_t.item())
            dt = time.perf_counter() - t0
            if k >= args.warmup:
                times[mode].append(dt)
            losses[mode].append(loss)
    params = trainable_param_count(engines["fast"][1])
    cost = reduction_cost(engines["canonical"][1], 4 * params, args.ranks)
    if rank == 0:
        out.put({"times": times, "losses": losses, "params": params, "cost": cost})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--ranks", 2), ("--accum", 2), ("--steps", 8), ("--warmup", 2), ("--hidden", 256),
                          ("--layers", 4), ("--vocab", 4096), ("--seq", 128), ("--batch", 4), ("--port", 29611)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--sharding", default="none", choices=["none", "full", "hybrid", "shard_grad_op"])
    ap.add_argument("--engine", default="standard", choices=["standard", "interleaved"],
                    help="the gradient source: autograd, or the flat-buffer walk (its gradients kept under both)")
    args = ap.parse_args()
    if args.sharding == "hybrid":
        os.environ.setdefault("APR_SHARD_GROUP_SIZE", str(max(1, args.ranks // 2)))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = out.get(timeout=1800)
    for p in procs:
        p.join()
    fast, canon = (statistics.median(res["times"][m]) * 1e3 for m in ("fast", "canonical"))
    dloss = max(abs(a - b) for a, b in zip(res["losses"]["fast"], res["losses"]["canonical"], strict=True))
    cost = res["cost"]
    print(f"training.engine {args.engine}, training.sharding {args.sharding}")
    print(f"{args.ranks} ranks x accumulation {args.accum}, {res['params'] / 1e6:.2f}M parameters, "
          f"batch {args.batch} x {args.seq}, {args.steps} timed steps (round-robin)")
    print(f"fast       {fast:9.1f} ms/step")
    print(f"canonical  {canon:9.1f} ms/step   canonical/fast {canon / fast:.3f}")
    print(f"canonical holds +{cost['extra_bytes'] / 2**20:.1f} MiB per rank ({cost['leaves']} leaves); "
          f"sends {cost['gathered_bytes'] / 2**20:.1f} MiB a step; max |dloss| fast vs canonical {dloss:.2e}")
    print(f"measured +{canon - fast:.1f} ms/step; the plan models +{cost['extra_seconds_per_step'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
