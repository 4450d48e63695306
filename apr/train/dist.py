"""Data parallelism on torch.distributed, as ``torchrun`` launches it (docs/design.md, "Data parallelism").

``torchrun --nproc_per_node=K -m apr train apply CONFIG`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and the rendezvous variables; ``from_env`` joins the process group (NCCL on CUDA,
gloo on the CPU) with a timeout, so that a rank that dies or stalls ends the job with an error
instead of a hang. Without those variables (a plain ``apr train apply``) there is no process group
and ``DataParallel`` is not used at all.
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist  # loaded by `import torch` anyway

from apr.launch import env_world_size

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class DataParallel:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    host_group: object | None = None  # gloo, for host-side flags under NCCL; None: the default group is gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum_async(self, tensor: torch.Tensor):
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)

    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place: the mean of ``tensor`` over all ranks."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.div_(self.world_size)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any_host(self, flags: list[int]) -> list[int]:
        """The element-wise maximum over ranks of a few host integers, over gloo on the CPU: nothing
        is read from the device, so the step's kernels stay queued behind it (the run loop's stop
        flags; docs/design.md, "The run loop")."""
        values = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.host_group)
        return values.tolist()

    def broadcast_host(self, obj):
        """Rank 0's ``obj`` (a small picklable value) on every rank, over the host group (steer requests)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def _device(self) -> torch.device:
        """Where this backend's collectives take their tensors (NCCL: the current GPU)."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def all_true(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective: every rank calls it)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def barrier(self) -> None:
        dist.barrier()

    def exchange_digests(self, sha: str, size: int) -> list[tuple[str, int]]:
        """Every rank's (SHA-256 hex or "", byte count), in rank order, on every rank (a checkpoint
        part's record; an all-gather of plain integers, no pickling)."""
        mine = torch.tensor([size, *sha.encode("ascii").ljust(64, b"\0")], dtype=torch.int64, device=self._device())
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        out = []
        for t in every:
            values = t.tolist()
            out.append((bytes(v for v in values[1:] if v).decode("ascii"), int(values[0])))
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def from_env(device_kind: str) -> DataParallel | None:
    """Join the process group torchrun describes; None when this is a single process."""
    world = env_world_size()
    if world <= 1:
        return None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    timeout = float(os.environ.get("APR_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout))
    # the run loop's per-step stop flags live on the host: under NCCL they travel over a gloo group,
    # so agreeing on them never waits for the device (created collectively, by every rank, here)
    host_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return DataParallel(rank=rank, world_size=world, local_rank=local_rank, backend=backend, host_group=host_group)
