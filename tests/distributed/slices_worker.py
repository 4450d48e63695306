"""A rank of tests/distributed/test_canonical.py's slicing test: ``CanonicalSum`` over this rank's
leaves of a length no world size divides; writes the mean and the loss it gets (rank 0)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from apr.train.dist import DataParallel
from apr.train.reduction import CanonicalSum


def main(out: str, numel: int, accum: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = DataParallel(rank=rank, world_size=world, local_rank=rank, backend="gloo")
    total = CanonicalSum(dp)
    for k in range(accum):  # global micro-batch j = k * world + rank: the same values on any layout
        j = k * world + rank
        g = torch.Generator().manual_seed(1000 + j)
        parts = [torch.randn(numel - 7, generator=g), torch.randn(7, generator=g)]
        total.take(parts, torch.tensor(float(j) / 3))
    mean, loss = total.reduce()
    if rank == 0:
        torch.save({"mean": mean, "loss": loss}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
