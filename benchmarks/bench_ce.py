"""The torch backend's cross-entropy step (issue 40; docs/performance.md, "Where a step's time
goes"), on one chunk of logits and in whole engine steps, interleaved A/B in one process, CPU time
(`time.thread_time`, one torch thread), bench_engine's 10.5M shape. Three ops: `logsumexp` then
`sub_`/`exp_` (the backend's op: two exp passes and a [rows, vocab] temporary), and two
candidates: `log_softmax` written over the logits then `exp_`, and "one exp" (logsumexp's own steps
in place over the logits, the exp'd values kept for the gradient: one exp pass). Each op is also
checked row by row: a slice of the rows alone must give the same bits as inside the whole chunk
(what data-parallel ranks rely on). Why neither candidate is the backend's op: docs/performance.md.

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
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine  # noqa: E402


def log_softmax_ce(logits, targets, *, grad_scale, ignore_index=-100):
    """log-softmax in one fused kernel written over the logits, then exp_."""
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


def one_exp_ce(logits, targets, *, grad_scale, ignore_index=-100):
    """torch.logsumexp's own steps (row max, infinite maxes as 0, sum of the exp'd differences, log
    plus max: the loss is bitwise logsumexp's) in place over the logits, the exp'd differences kept:
    the gradient is exps / sum - onehot, one exp pass and no temporary."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    target_logit = logits.gather(1, safe[:, None]).squeeze(1)
    row_max = logits.amax(dim=-1, keepdim=True)
    row_max.masked_fill_(row_max.abs() == float("inf"), 0)
    exps = logits.sub_(row_max).exp_()
    sums = exps.sum(dim=-1)
    loss_sum = torch.where(valid, sums.log().add_(row_max.squeeze(1)) - target_logit, 0.0).sum()
    scale = valid.to(logits.dtype) * grad_scale
    exps.mul_((scale / sums)[:, None])
    exps.scatter_add_(1, safe[:, None], -scale[:, None])
    return loss_sum


def _row_independent(fn, logits, targets) -> bool:
    """Whether slices of the rows alone give the bits they get inside the whole chunk."""
    whole = logits.clone()
    fn(TorchBackend(), whole, targets, grad_scale=1 / 2048)
    for rows in (slice(0, 1024), slice(7, 8), slice(100, 1900)):
        part = logits[rows].clone()
        fn(TorchBackend(), part, targets[rows], grad_scale=1 / 2048)
        if not torch.equal(part, whole[rows]):
            return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    backend = TorchBackend.cross_entropy_fwd_bwd
    variants = {"logsumexp (apr)": lambda self, *a, **k: logsumexp_ce(*a, **k),
                "log_softmax": lambda self, *a, **k: log_softmax_ce(*a, **k),
                "one exp": lambda self, *a, **k: one_exp_ce(*a, **k)}
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2048, 8192, generator=gen) * 3
    targets = torch.randint(0, 8192, (2048,), generator=gen)
    rowwise = {name: _row_independent(fn, logits, targets) for name, fn in variants.items()}
    shape = argparse.Namespace(hidden=256, layers=6, heads=4, kv_heads=4, intermediate=1024, vocab=8192, tied=False,
                               seq=256, batch=8, loss_chunk=256, device="cpu", precision=None, kernels="torch")
    engine = build_engine(plan_of(bench_engine.make_config(shape, engine="interleaved", clip_mode="global",
                                                   execution=("keep", "kept"))))
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
    print(f"{'variant':<20}{'CE op ms':>10}{'x':>7}{'step ms':>10}{'x':>7}  {'rows alone':<11} loss of the chunk")
    for name in variants:
        o, s = statistics.median(op[name]), statistics.median(step[name])
        print(f"{name:<20}{o * 1e3:>10.1f}{base_op / o:>7.2f}{s * 1e3:>10.0f}{base_step / s:>7.3f}  "
              f"{'same bits' if rowwise[name] else 'DIFFER':<11} {losses[name][0]!r}")


if __name__ == "__main__":
    main()
