"""apr's data-parallel engines, unsharded and on FSDP2 shards, against plain PyTorch loops on the
same ranks (docs/performance.md, "Sharding").

    torchrun --standalone --nproc_per_node=N benchmarks/bench_sharding.py [--device cpu|cuda]
        [--hidden 256] [--layers 6] [--heads 4] [--kv-heads 4] [--intermediate 1024] [--vocab 8192]
        [--seq 256] [--batch 8] [--warmup 2] [--steps 10] [--only NAME,...] [--json]

Without torchrun it runs as one rank (a process group of one): sharding's overhead alone, with no
communication to hide, which is what "FSDP2 against DDP on one GPU" measures.

Approaches (one after the other; every rank reads its own random batches; the same initial weights
everywhere; fp32 on the CPU, bf16 autocast on CUDA, fp32 master weights):

  torch/ddp              the plain loop: DistributedDataParallel, full [batch, seq, vocab] logits +
                         F.cross_entropy, clip_grad_norm_(1.0), torch AdamW (foreach)
  torch/fsdp2            the same loop on fully_shard per decoder block and at the root
                         (reshard after forward: full sharding)
  apr/E/none             build_engine(plan_of(engine E), training.sharding none): the engine all-reduces
                         gradients itself (E: standard or interleaved, its auto execution policy)
  apr/E/full             training.sharding full (apr/train/sharded.py, sharded_walk.py)
  apr/E/shard_grad_op    training.sharding shard_grad_op (with --only)
  apr/interleaved/full-lean  full sharding, full recompute and one gradient shard at a time
                         (activations recompute, gradients workspace; the 7B setting of docs/plan.md)

Reported on rank 0: the median over timed steps of the slowest rank's step time (an all-reduce of
each step's time, max), tokens/s over all ranks, the ratio to torch/ddp, peak memory per rank
(CUDA ``max_memory_allocated``, the largest rank's; not measured on the CPU) and the last step's
loss averaged over the ranks.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from apr.steps.resolved import resolve as plan_of  # noqa: E402

LR = 3e-4
SEED = 1234
APR = {  # name -> (engine, sharding, (activations, gradients) or None: the engine's auto policy)
    "apr/standard/none": ("standard", "none", None),
    "apr/interleaved/none": ("interleaved", "none", None),
    "apr/standard/full": ("standard", "full", None),
    "apr/interleaved/full": ("interleaved", "full", None),
    "apr/interleaved/full-lean": ("interleaved", "full", ("recompute", "workspace")),
    "apr/standard/shard_grad_op": ("standard", "shard_grad_op", None),
    "apr/interleaved/shard_grad_op": ("interleaved", "shard_grad_op", None),
}
BASELINES = ("torch/ddp", "torch/fsdp2")
DEFAULT = (*BASELINES, "apr/standard/none", "apr/interleaved/none", "apr/standard/full", "apr/interleaved/full",
           "apr/interleaved/full-lean")


def make_config(args, engine: str, sharding: str, execution, world: int):
    from apr.config.schema import AprConfig

    activations, gradients = execution or ("auto", "auto")
    cuda = args.device == "cuda"
    return AprConfig.model_validate({
        "model": {"architecture": {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "intermediate_size": args.intermediate,
            "vocab_size": args.vocab, "max_position_embeddings": args.seq}},
        "data": {"train": "unused/", "batch_size": args.batch, "seq_len": args.seq},
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "training": {"engine": engine, "sharding": sharding, "world_size": world, "grad_clip": 1.0,
                     "mixed_precision": "bf16" if cuda else "fp32", "device": args.device,
                     "kernels": "auto" if cuda else "torch", "seed": SEED,
                     "execution": {"activations": activations, "gradients": gradients}},
    })


def join(device_kind: str):
    """torchrun's process group, or a group of one when run as a plain process."""
    from apr.train.dist import DataParallel, from_env

    dp = from_env(device_kind)
    if dp is not None:
        return dp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend=backend, rank=0, world_size=1)
    return DataParallel(rank=0, world_size=1, local_rank=0, backend=backend)


def build_apr(args, name: str, device: torch.device, dp):
    from apr.steps import execution as policy
    from apr.train.build import build_engine

    engine_kind, sharding, execution = APR[name]
    config = make_config(args, engine_kind, sharding, execution, dp.world_size)
    chosen = policy.from_config(config)
    engine = build_engine(plan_of(config, execution=chosen), device, dp=dp)
    note = f"{type(engine).__name__}; {policy.describe(config, chosen)}"

    def step(batch: torch.Tensor) -> torch.Tensor:
        return engine.train_step([batch], LR).loss

    return step, note, [engine]


def build_torch(args, name: str, device: torch.device, dp):
    """The plain loop, under DDP or on FSDP2 shards."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from apr.model import spec
    from apr.model.llama import build_model

    config = make_config(args, "standard", "none", None, dp.world_size)
    arch = config.model.architecture
    model = build_model(arch, SEED, device="cpu").to(device)
    decay = {s.name for s in spec.param_specs(arch) if s.decay}
    if name == "torch/fsdp2":
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    named = dict(model.named_parameters())  # after fully_shard: the DTensor parameters
    groups = [{"params": [p for n, p in named.items() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    params = list(named.values())
    cast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
            else torch.autocast(device.type, enabled=False))

    def step(batch: torch.Tensor) -> torch.Tensor:
        ids, targets = batch[:, :-1], batch[:, 1:]
        with cast:
            logits = wrapped(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, "full logits + F.cross_entropy, clip_grad_norm_, torch AdamW (foreach)", [model, opt]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reduce_max(value: float, device: torch.device, dp) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device if dp.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def reduce_mean(value: float, device: torch.device, dp) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device if dp.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / dp.world_size


def measure(args, name: str, device: torch.device, dp, data: list[torch.Tensor]) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step, note, keep = (build_torch if name in BASELINES else build_apr)(args, name, device, dp)
    for batch in data[: args.warmup]:
        step(batch)
    sync(device)
    warm_s = time.perf_counter() - t0
    times, loss = [], None
    for batch in data[args.warmup:]:
        dist.barrier()
        sync(device)
        t = time.perf_counter()
        loss = step(batch)
        sync(device)
        times.append(reduce_max(time.perf_counter() - t, device, dp))
    peak = None
    if device.type == "cuda":
        peak = reduce_max(float(torch.cuda.max_memory_allocated(device)), device, dp)
    last = reduce_mean(float(loss), device, dp)
    del step, keep
    gc.collect()
    tokens = args.batch * args.seq * dp.world_size
    med = statistics.median(times)
    return {"approach": name, "step_ms_median": med * 1e3, "step_ms_min": min(times) * 1e3,
            "tokens_per_s": tokens / med, "peak_mib": None if peak is None else peak / 2**20,
            "warm_s": warm_s, "last_loss": last, "note": note}


def run(args) -> dict | None:
    device = torch.device(args.device)
    dp = join(device.type)
    if device.type == "cuda":
        device = torch.device("cuda", dp.local_rank)
    gen = torch.Generator().manual_seed(1000 + dp.rank)  # each rank its own rows
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
            for _ in range(args.warmup + args.steps)]
    names = [n for n in (*BASELINES, *APR) if (n in args.only if args.only else n in DEFAULT)]
    rows = []
    for name in names:
        rows.append(measure(args, name, device, dp, data))
        if dp.is_main:
            print(f"  {name}: done", file=sys.stderr, flush=True)
    from apr.model.spec import param_count

    arch = make_config(args, "standard", "none", None, dp.world_size).model.architecture
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine,
              "torch": torch.__version__, "device": args.device, "ranks": dp.world_size,
              "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
              "params": param_count(arch), "batch_per_rank": args.batch, "seq": args.seq,
              "warmup": args.warmup, "steps": args.steps, "results": rows}
    dp.close()
    return result if dp.is_main else None


def render(res: dict) -> str:
    out = [f"bench_sharding  {res['date']}  {res['machine']}  torch {res['torch']}  {res['ranks']} rank(s) on "
           f"{res['device']}, {res['precision']}",
           f"model {res['params'] / 1e6:.2f}M params; batch {res['batch_per_rank']} x seq {res['seq']} per rank; "
           f"{res['warmup']} warmup + {res['steps']} timed steps (median of the slowest rank's step)", ""]
    base = next((r for r in res["results"] if r["approach"] == "torch/ddp"), None)
    head = f"{'approach':<30} {'step ms':>9} {'tokens/s':>10} {'x ddp':>6} {'peak MiB':>9} {'last loss':>9}"
    out += [head, "-" * len(head)]
    for r in res["results"]:
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        out.append(f"{r['approach']:<30} {r['step_ms_median']:>9.1f} {r['tokens_per_s']:>10.0f} {ratio:>6} "
                   f"{peak:>9} {r['last_loss']:>9.4f}")
    out += ["", *(f"{r['approach']}: {r['note']}" for r in res["results"])]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    for key, default in (("hidden", 256), ("layers", 6), ("heads", 4), ("kv-heads", 4), ("intermediate", 1024),
                         ("vocab", 8192), ("seq", 256), ("batch", 8), ("warmup", 2), ("steps", 10)):
        p.add_argument(f"--{key}", type=int, default=default)
    p.add_argument("--only", type=lambda s: s.split(","), default=None, help="comma-separated approaches")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    unknown = set(args.only or ()) - {*BASELINES, *APR}
    if unknown:
        p.error(f"unknown approaches {sorted(unknown)}; choose from {', '.join((*BASELINES, *APR))}")
    res = run(args)
    if res is not None:
        print(json.dumps(res, indent=1) if args.json else render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
