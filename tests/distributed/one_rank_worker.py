"""A process group of one: the engine built on FSDP2 shards (training.sharding, world 1) and the
same engine unsharded, stepped on the same batches; prints the largest relative difference of their
weights and AdamW moments. argv: store file, device, engine, sharding, kernels, steps, activations,
gradients (training.execution).
Run as a subprocess by tests/distributed/test_sharding_one_rank.py."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from apr.train.dist import DataParallel
from tests.train.tiny import batches, make_config


def main() -> int:
    store, device, engine_kind, sharding, kernels, steps, activations, gradients = sys.argv[1:9]
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    dp = DataParallel(rank=0, world_size=1, local_rank=0, backend=backend)
    training = {"engine": engine_kind, "device": device, "kernels": kernels,
                "execution": {"activations": activations, "gradients": gradients}}
    plain = make_config(training={**training, "sharding": "none"})
    sharded = make_config(training={**training, "sharding": sharding})
    data = batches(plain, int(steps))
    ref = build_engine(plan_of(plain), torch.device(device))
    eng = build_engine(plan_of(sharded), torch.device(device), dp=dp)
    for batch in data:
        ref.train_step([batch.to(device)], 3e-3)
        eng.train_step([batch.to(device)], 3e-3)
    a, b = eng.train_state_tensors(), ref.train_state_tensors()
    assert set(a) == set(b), set(a) ^ set(b)
    rel = max(((a[k].float().cpu() - b[k].float().cpu()).norm() / b[k].float().cpu().norm().clamp_min(1e-30)).item()
              for k in b)
    print(json.dumps({"rel": rel, "sharded": type(eng.layout).__name__, "plain": type(ref.layout).__name__,
                      "backend": eng.backend.name}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
