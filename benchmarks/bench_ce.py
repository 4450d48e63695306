"""A fused cross-entropy step for the torch backend (issue 40; docs/performance.md, "Where a step's
time goes"): `log_softmax` written over the logits (the candidate, here), against the backend's
`logsumexp` then `sub_`/`exp_`, on one chunk of logits and in whole engine steps, interleaved A/B
in one process, CPU time (`time.thread_time`, one torch thread), bench_engine's 10.5M shape. The
candidate is 2.3x faster on the chunk but is not the backend's op: its rounding depends on the
batch layout, so one process and data-parallel ranks no longer agree within 1e-6 (see the doc).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ce.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine  # noqa: E402

from apr.kernels.torch_backend import TorchBackend  # noqa: E402
from apr.train.build import build_engine  # noqa: E402


def log_softmax_ce(logits, targets, *, grad_scale, ignore_index=-100):
    """The candidate: log-softmax in one fused kernel written over the logits, then exp_."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    logp = torch.log_softmax(logits, dim=-1, out=logits)
    loss_sum = -torch.where(valid, logp.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    logits.exp_()
    minus_one = torch.full((len(targets), 1), -1.0, dtype=logits.dtype, device=logits.device)
    logits.scatter_add_(1, safe[:, None], minus_one)
    logits.mul_((valid.to(logits.dtype) * grad_scale)[:, None])
    return loss_sum


def logsumexp_ce(logits, targets, *, grad_scale, ignore_index=-100):
    """The backend's cross-entropy (a copy): logsumexp, then the gradient by sub_ and exp_."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    lse = torch.logsumexp(logits, dim=-1)
    loss_sum = torch.where(valid, lse - logits.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    logits.sub_(lse[:, None]).exp_()
    logits.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
    logits.mul_((valid.to(logits.dtype) * grad_scale)[:, None])
    return loss_sum


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    backend = TorchBackend.cross_entropy_fwd_bwd
    variants = {"logsumexp (apr)": lambda self, *a, **k: logsumexp_ce(*a, **k),
                "log_softmax": lambda self, *a, **k: log_softmax_ce(*a, **k)}
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2048, 8192, generator=gen) * 3
    targets = torch.randint(0, 8192, (2048,), generator=gen)
    shape = argparse.Namespace(hidden=256, layers=6, heads=4, kv_heads=4, intermediate=1024, vocab=8192, tied=False,
                               seq=256, batch=8, loss_chunk=256, device="cpu", precision=None, kernels="torch")
    engine = build_engine(bench_engine.make_config(shape, engine="interleaved", clip_mode="global",
                                                   execution=("keep", "kept")))
    batches = [torch.randint(0, 8192, (8, 257), generator=gen) for _ in range(args.rounds + 1)]
    op, step, losses = ({k: [] for k in variants} for _ in range(3))
    engine.train_step([batches[0]], 3e-4)
    for r in range(args.rounds):
        for name, fn in variants.items():
            TorchBackend.cross_entropy_fwd_bwd = fn
            chunk = logits.clone()
            t0 = time.thread_time()
            losses[name].append(float(fn(TorchBackend(), chunk, targets, grad_scale=1 / 2048)))
            op[name].append(time.thread_time() - t0)
            t0 = time.thread_time()
            float(engine.train_step([batches[r + 1]], 3e-4).loss)
            step[name].append(time.thread_time() - t0)
    TorchBackend.cross_entropy_fwd_bwd = backend
    base_op, base_step = (statistics.median(d["logsumexp (apr)"]) for d in (op, step))
    print(f"{'variant':<20}{'CE op ms':>10}{'x':>7}{'step ms':>10}{'x':>7}  loss of the chunk")
    for name in variants:
        o, s = statistics.median(op[name]), statistics.median(step[name])
        print(f"{name:<20}{o * 1e3:>10.1f}{base_op / o:>7.2f}{s * 1e3:>10.0f}{base_step / s:>7.3f}  "
              f"{losses[name][0]!r}")


if __name__ == "__main__":
    main()
