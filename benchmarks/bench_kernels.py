"""apr's CuPy kernels against their torch equivalents, on one CUDA device, in one run.

  adamw     apr_adamw_f32 over one flat float32 buffer (param, grad, m, v; decay on the whole
            buffer) against torch.optim.AdamW(fused=True) and (foreach=True) over the same buffer
            as one parameter, and the torch reference backend (apr.kernels.torch_backend).
            Also with the bf16 compute-copy write, against fused AdamW + param.to(bf16).
            Bytes moved: 28 per element (read p, g, m, v; write p, m, v), +2 with the copy; shown
            as GB/s and as a fraction of the device-to-device copy bandwidth measured here.
  sq_norm   apr's two-stage squared norm against torch.linalg.vector_norm(x).square() and
            torch._foreach_norm.
  ce        apr's one-pass cross-entropy (loss + d_logits in place) over a [rows, vocab] float32
            chunk against F.cross_entropy(reduction="sum") forward + backward (autograd), and the
            torch reference backend (in place). "extra MiB" is the peak allocation above the
            inputs during one call.

Timing: CUDA events around each call, median over --iters calls after --warmup calls; inputs that
a call overwrites are restored before each call, outside the timed region. "x" = torch time /
apr time (above 1: apr is faster).

    .venv/bin/python benchmarks/bench_kernels.py [--quick] [--iters 50] [--warmup 10] [--json OUT]

On a machine without a CUDA device it prints "no CUDA device: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MiB = 2**20
HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
ADAMW_SIZES = [(1 << 20) + 3, 15_204_352, 67_108_864]  # odd, one 350M block, 64M
NORM_SIZES = [(1 << 20) + 3, 15_204_352, 67_108_864]
CE_SHAPES = [(1024, 32_768), (2048, 32_768), (1024, 50_257), (4096, 8_192)]


def median_ms(fn, iters: int, warmup: int, before=None) -> float:
    """Median wall time of ``fn()`` on the current stream, CUDA events around each call."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        if before:
            before()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def peak_extra_bytes(fn, before=None) -> int:
    """Peak bytes allocated above the current level during one call of ``fn``."""
    if before:
        before()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth(iters: int, warmup: int) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), 512 MiB buffers."""
    n = 128 * MiB
    src = torch.empty(n, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters, warmup)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def bench_adamw(cb, ref, n: int, args, copy_gbs: float) -> list[dict]:
    from apr.kernels import DecayRanges

    decay = DecayRanges.from_segments([(n, True)])
    gen = torch.Generator(device="cuda").manual_seed(n)
    p = torch.randn(n, device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    m = torch.zeros(n, device="cuda")
    v = torch.zeros(n, device="cuda")
    copy = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    rows = []

    def ours():
        cb.adamw_step(p, g, m, v, step=10, decay=decay, **HP)

    def ours_copy():
        cb.adamw_step(p, g, m, v, step=10, decay=decay, param_copy=copy, **HP)

    t_ours = median_ms(ours, args.iters, args.warmup)
    t_ours_copy = median_ms(ours_copy, args.iters, args.warmup)

    def torch_opt(kind: str):
        param = torch.nn.Parameter(p.clone())
        param.grad = g.clone()
        opt = torch.optim.AdamW([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                                weight_decay=HP["weight_decay"], **{kind: True})
        return param, opt

    fused_p, fused = torch_opt("fused")
    t_fused = median_ms(fused.step, args.iters, args.warmup)
    t_fused_copy = median_ms(lambda: (fused.step(), copy.copy_(fused_p.detach())), args.iters, args.warmup)
    fe_p, foreach = torch_opt("foreach")
    t_foreach = median_ms(foreach.step, args.iters, args.warmup)
    g2 = g.clone()
    t_ref = median_ms(lambda: ref.adamw_step(p, g2, m, v, step=10, decay=decay, **HP), args.iters, args.warmup,
                      before=lambda: g2.copy_(g))

    def gbs(ms: float, per_elem: int) -> float:
        return n * per_elem / (ms * 1e-3) / 1e9

    base = dict(op="adamw", size=n)
    rows.append({**base, "variant": "f32", "apr_ms": t_ours, "GB/s": gbs(t_ours, 28),
                 "of_copy_bw": gbs(t_ours, 28) / copy_gbs, "torch_fused_ms": t_fused, "x_fused": t_fused / t_ours,
                 "torch_foreach_ms": t_foreach, "x_foreach": t_foreach / t_ours, "torch_ref_ms": t_ref,
                 "x_ref": t_ref / t_ours})
    rows.append({**base, "variant": "f32+bf16 copy", "apr_ms": t_ours_copy, "GB/s": gbs(t_ours_copy, 30),
                 "of_copy_bw": gbs(t_ours_copy, 30) / copy_gbs, "torch_fused_ms": t_fused_copy,
                 "x_fused": t_fused_copy / t_ours_copy})
    return rows


def bench_sq_norm(cb, n: int, args, copy_gbs: float) -> dict:
    x = torch.randn(n, device="cuda")
    t_ours = median_ms(lambda: cb.sq_norm(x), args.iters, args.warmup)
    t_vn = median_ms(lambda: torch.linalg.vector_norm(x).square(), args.iters, args.warmup)
    t_fe = median_ms(lambda: torch._foreach_norm([x])[0].square(), args.iters, args.warmup)
    gbs = n * 4 / (t_ours * 1e-3) / 1e9
    return {"op": "sq_norm", "size": n, "variant": "f32", "apr_ms": t_ours, "GB/s": gbs,
            "of_copy_bw": gbs / copy_gbs, "torch_vector_norm_ms": t_vn, "x_vector_norm": t_vn / t_ours,
            "torch_foreach_norm_ms": t_fe, "x_foreach_norm": t_fe / t_ours}


def bench_ce(cb, ref, rows: int, vocab: int, args) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits0 = torch.randn(rows, vocab, device="cuda", generator=gen) * 3
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    work = torch.empty_like(logits0)

    def restore():
        work.copy_(logits0)

    def ours():
        cb.cross_entropy_fwd_bwd(work, targets, grad_scale=1.0 / rows)

    def torch_ref():
        ref.cross_entropy_fwd_bwd(work, targets, grad_scale=1.0 / rows)

    leaf = logits0.clone().requires_grad_()

    def torch_f():
        leaf.grad = None
        (F.cross_entropy(leaf, targets, reduction="sum") * (1.0 / rows)).backward()

    t_ours = median_ms(ours, args.iters, args.warmup, before=restore)
    t_ref = median_ms(torch_ref, args.iters, args.warmup, before=restore)
    t_f = median_ms(torch_f, args.iters, args.warmup)
    mem_ours = peak_extra_bytes(ours, before=restore)
    mem_ref = peak_extra_bytes(torch_ref, before=restore)
    leaf.grad = None
    mem_f = peak_extra_bytes(torch_f)
    gbs = rows * vocab * 12 / (t_ours * 1e-3) / 1e9  # read twice, write once
    return {"op": "ce", "size": f"{rows}x{vocab}", "variant": "f32 fwd+bwd", "apr_ms": t_ours, "GB/s": gbs,
            "torch_F_ms": t_f, "x_F": t_f / t_ours, "torch_ref_ms": t_ref, "x_ref": t_ref / t_ours,
            "apr_extra_MiB": mem_ours / MiB, "torch_F_extra_MiB": mem_f / MiB, "torch_ref_extra_MiB": mem_ref / MiB}


def fmt_row(r: dict) -> str:
    skip = {"op", "size", "variant"}
    parts = []
    for k, v in r.items():
        if k in skip:
            continue
        parts.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
    return f"{r['op']:8s} {str(r['size']):>14s} {r['variant']:14s} " + " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="one size per kernel")
    ap.add_argument("--json", type=Path, help="also write the rows and the machine description here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    from apr.kernels import cupy_unavailable_reason, get_backend

    reason = cupy_unavailable_reason()
    if reason is not None:
        print(f"CUDA device present but the CuPy backend is unavailable: {reason}")
        return 1
    cb, ref = get_backend("cupy", "cuda"), get_backend("torch", "cuda")
    import cupy

    props = torch.cuda.get_device_properties(0)
    header = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": props.name, "sm_count": props.multi_processor_count, "vram_GiB": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cupy": cupy.__version__,
        "python": platform.python_version(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    copy_gbs = copy_bandwidth(args.iters, args.warmup)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
    rows: list[dict] = []
    adamw_sizes = ADAMW_SIZES[1:2] if args.quick else ADAMW_SIZES
    norm_sizes = NORM_SIZES[1:2] if args.quick else NORM_SIZES
    ce_shapes = CE_SHAPES[:1] if args.quick else CE_SHAPES
    for n in adamw_sizes:
        for r in bench_adamw(cb, ref, n, args, copy_gbs):
            rows.append(r)
            print(fmt_row(r), flush=True)
        torch.cuda.empty_cache()
    for n in norm_sizes:
        rows.append(bench_sq_norm(cb, n, args, copy_gbs))
        print(fmt_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    for r_, v_ in ce_shapes:
        rows.append(bench_ce(cb, ref, r_, v_, args))
        print(fmt_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**header, "copy_GBps": copy_gbs, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
