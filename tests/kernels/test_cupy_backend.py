"""The CuPy backend against the torch reference.

Tests marked ``gpu`` need a CUDA device and CuPy (skipped without a device by tests/conftest.py,
and without CuPy here). They compare every kernel with ``TorchBackend`` on the same device (float32,
the same op sequence: equal to a few ulps) and with a float64 reference, on random inputs of
awkward sizes (empty, tiny, not multiples of 4, misaligned, large), with outputs poisoned first so
an element the kernel forgets to write shows up. Then the whole engine: ``training.kernels: cupy``
against ``torch`` on CUDA and against the CPU reference.

The unmarked tests are CPU twins: NumPy models of the kernels' arithmetic (the host-computed AdamW
scalars, the online-softmax merge with its NaN/-inf rules, the two-stage norm) against the torch
reference, so the algorithms are checked where no GPU exists.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from apr.errors import AprError
from apr.kernels import DecayRanges, get_backend
from apr.kernels.cupy_backend import ADAMW_SCALARS, adamw_scalars
from apr.kernels.torch_backend import TorchBackend
from apr.steps.resolved import resolve as plan_of


def decay_mask(decay: DecayRanges) -> torch.Tensor:
    """One bool per element of the flat buffer, True where it decays (the test's own oracle)."""
    mask = torch.zeros(decay.numel, dtype=torch.bool)
    for start, end in decay.ranges:
        mask[start:end] = True
    return mask

REF = TorchBackend()
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def cb():
    """The CuPy backend on cuda:0 (compiles the kernels once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("cupy")
    backend = get_backend("cupy", torch.device("cuda"))
    assert backend.name == "cupy"
    return backend


def _dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poison_allocator(nbytes: int) -> None:
    """Fill and free a block so torch's caching allocator hands NaN-filled memory to the next
    allocations of about this size (the kernels' own scratch and outputs)."""
    block = torch.full((max(nbytes // 4, 1) + 256,), float("nan"), device=_dev())
    del block


def _misaligned(t: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """A copy of ``t`` whose storage starts ``offset`` elements into a larger buffer."""
    big = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = big[offset:]
    view.copy_(t.reshape(-1))
    return view


def _segments(n: int, gen: torch.Generator) -> list[tuple[int, bool]]:
    """Random (numel, decays) segments summing to n, like norms between matrices."""
    out, left, decays = [], n, False
    while left:
        k = min(left, int(torch.randint(1, max(2, n // 3 + 2), (1,), generator=gen)))
        out.append((k, decays))
        left -= k
        decays = not decays
    return out


def _assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------ AdamW

ADAMW_SIZES = [1, 3, 4, 5, 17, 1000, 4099, (1 << 20) + 3]
HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _adamw_inputs(n: int, seed: int, device) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    return {"param": torch.randn(n, generator=g).to(device), "grad": torch.randn(n, generator=g).to(device),
            "exp_avg": (torch.randn(n, generator=g) * 0.1).to(device),
            "exp_avg_sq": (torch.rand(n, generator=g) * 0.01).to(device)}


def _clone(d: dict[str, torch.Tensor], **kw) -> dict[str, torch.Tensor]:
    return {k: v.clone().to(**kw) for k, v in d.items()}


@gpu
@pytest.mark.parametrize("n", ADAMW_SIZES)
@pytest.mark.parametrize("aligned", [True, False])
def test_adamw_matches_the_reference_over_steps_with_decay_ranges(cb, n, aligned):
    dev = _dev()
    x = _adamw_inputs(n, seed=n, device=dev)
    decay = DecayRanges.from_segments(_segments(n, _gen(n + 1)))
    ours = {k: (v.clone() if aligned else _misaligned(v)) for k, v in x.items()}
    ref32 = _clone(x)
    ref64 = _clone(x, dtype=torch.float64)
    for step in (1, 2, 3, 10):
        grad = torch.randn(n, generator=_gen(100 * step + n)).to(dev)
        ours["grad"].copy_(grad)
        cb.adamw_step(ours["param"], ours["grad"], ours["exp_avg"], ours["exp_avg_sq"], step=step, decay=decay, **HP)
        REF.adamw_step(ref32["param"], grad.clone(), ref32["exp_avg"], ref32["exp_avg_sq"], step=step, decay=decay,
                       **HP)
        REF.adamw_step(ref64["param"], grad.double(), ref64["exp_avg"], ref64["exp_avg_sq"], step=step, decay=decay,
                       **HP)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        _assert_close(ours[k], ref32[k], rtol=2e-6, atol=1e-7, what=f"{k} vs float32 reference")
        _assert_close(ours[k].double(), ref64[k], rtol=1e-5, atol=1e-7, what=f"{k} vs float64 reference")
    assert torch.equal(ours["grad"], grad)  # only read


@gpu
def test_adamw_decays_exactly_the_ranges(cb):
    n = 4099
    dev = _dev()
    decay = DecayRanges.from_segments([(5, False), (1000, True), (3, False), (3000, True), (91, False)])
    p = torch.ones(n, device=dev)
    cb.adamw_step(p, torch.zeros(n, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev), lr=0.5,
                  beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.2, step=1, decay=decay)
    expect = torch.ones(n, device=dev)
    expect[decay_mask(decay).to(dev)] = float(np.float32(1 - 0.5 * 0.2))  # CUDA tensors take no NumPy scalar
    assert torch.equal(p, expect)


@gpu
@pytest.mark.parametrize("kind", ["float", "device_tensor", "host_tensor"])
def test_adamw_grad_scale_forms_match_a_prescaled_gradient(cb, kind):
    n, dev = 1027, _dev()
    x = _adamw_inputs(n, seed=7, device=dev)
    decay = DecayRanges.from_segments([(n, True)])
    scale = 0.37
    value = {"float": scale, "device_tensor": torch.tensor(scale, device=dev),
             "host_tensor": torch.tensor(scale)}[kind]
    a = _clone(x)
    cb.adamw_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], step=1, decay=decay, grad_scale=value, **HP)
    b = _clone(x)
    REF.adamw_step(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], step=1, decay=decay,
                   grad_scale=torch.tensor(scale, device=dev), **HP)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        _assert_close(a[k], b[k], rtol=2e-6, atol=1e-7, what=k)


@gpu
@pytest.mark.parametrize("flag_dtype", [torch.bool, torch.uint8, torch.float32])
def test_adamw_found_inf_skips_on_the_device(cb, flag_dtype):
    n, dev = 1001, _dev()
    x = _adamw_inputs(n, seed=3, device=dev)
    decay = DecayRanges.from_segments([(n, True)])
    copy = torch.full((n,), float("nan"), device=dev, dtype=torch.bfloat16)
    skipped = _clone(x)
    skipped["grad"].fill_(float("nan"))
    cb.adamw_step(skipped["param"], skipped["grad"], skipped["exp_avg"], skipped["exp_avg_sq"], step=1, decay=decay,
                  found_inf=torch.ones((), dtype=flag_dtype, device=dev), param_copy=copy, **HP)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(skipped[k], x[k]), k
    assert torch.isnan(copy.float()).all()  # untouched
    taken = _clone(x)
    cb.adamw_step(taken["param"], taken["grad"], taken["exp_avg"], taken["exp_avg_sq"], step=1, decay=decay,
                  found_inf=torch.zeros((), dtype=flag_dtype, device=dev), **HP)
    assert not torch.equal(taken["param"], x["param"])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [3, 4, 1001, 65541])
def test_adamw_writes_the_16bit_compute_copy(cb, dtype, n):
    dev = _dev()
    x = _adamw_inputs(n, seed=11, device=dev)
    x["param"][0] = 1e5  # overflows float16: inf, as torch's conversion gives
    decay = DecayRanges.from_segments([(n, True)])
    copy = torch.full((n,), float("nan"), device=dev, dtype=dtype)
    cb.adamw_step(x["param"], x["grad"], x["exp_avg"], x["exp_avg_sq"], step=1, decay=decay, param_copy=copy, **HP)
    assert torch.equal(copy, x["param"].to(dtype))
    odd = torch.full((n + 1,), float("nan"), device=dev, dtype=dtype)[1:]  # 2-byte aligned only: scalar path
    cb.adamw_step(x["param"], x["grad"], x["exp_avg"], x["exp_avg_sq"], step=2, decay=decay, param_copy=odd, **HP)
    assert torch.equal(odd, x["param"].to(dtype))


@gpu
def test_adamw_rejects_bad_buffers(cb):
    dev = _dev()
    d = DecayRanges.from_segments([(8, True)])
    z = torch.zeros(8, device=dev)
    with pytest.raises(AprError):
        cb.adamw_step(z.double(), z, z.clone(), z.clone(), step=1, decay=d, **HP)
    with pytest.raises(AprError):
        cb.adamw_step(z, z[:7], z.clone(), z.clone(), step=1, decay=d, **HP)
    with pytest.raises(AprError):
        cb.adamw_step(z, z.clone(), z.clone(), z.clone(), step=0, decay=d, **HP)
    with pytest.raises(AprError):
        cb.adamw_step(z.cpu(), z.clone(), z.clone(), z.clone(), step=1, decay=d, **HP)


# ---------------------------------------------------------------------------------------- sq_norm

NORM_SIZES = [0, 1, 3, 5, 1023, 4097, 10_000_001]


@gpu
@pytest.mark.parametrize("n", NORM_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sq_norm_matches_float64(cb, n, dtype):
    dev = _dev()
    x = (torch.randn(n, generator=_gen(n)) * 3).to(dev, dtype)
    exact = (x.double() ** 2).sum()
    for t in (x, _misaligned(x)):
        _poison_allocator(1024 * 8)
        s = cb.sq_norm(t)
        assert s.dtype == torch.float32 and s.dim() == 0 and s.device == t.device
        _assert_close(s.double(), exact, rtol=1e-6, atol=1e-30, what=f"sq_norm n={n}")
        _assert_close(s, REF.sq_norm(t), rtol=1e-5, atol=1e-30, what="vs torch reference")


@gpu
def test_sq_norm_is_reproducible_and_flags_non_finite(cb):
    dev = _dev()
    x = torch.randn(3_000_017, generator=_gen(0)).to(dev)
    assert torch.equal(cb.sq_norm(x), cb.sq_norm(x.clone()))
    for bad in (float("inf"), float("nan"), 1e20):  # 1e20 squared overflows float32, as in fp16 overflow
        y = x.clone()
        y[123_457] = bad
        assert not torch.isfinite(cb.sq_norm(y)).item()
    # a non-contiguous input goes through a contiguous copy
    m = torch.randn(33, 17, generator=_gen(1)).to(dev)
    _assert_close(cb.sq_norm(m.t()), (m.double() ** 2).sum().float(), rtol=1e-6, atol=0, what="transposed")


# ---------------------------------------------------------------------------------- cross-entropy

CE_SHAPES = [(1, 1), (3, 5), (7, 37), (16, 1000), (5, 4099), (33, 32768), (4, 50257), (2, 131072)]


def _ce_inputs(rows: int, vocab: int, seed: int, device, scale: float = 4.0):
    g = _gen(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(device)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
    if rows > 2:
        targets[[1, rows - 1]] = -100
    return logits, targets


def _ce_float64(logits: torch.Tensor, targets: torch.Tensor, grad_scale: float, ignore_index: int = -100):
    ref = logits.double().requires_grad_()
    loss = F.cross_entropy(ref, targets, ignore_index=ignore_index, reduction="sum")
    (loss * grad_scale).backward()
    return loss.detach(), ref.grad


@gpu
@pytest.mark.parametrize("rows,vocab", CE_SHAPES)
def test_cross_entropy_fwd_bwd_matches_float64(cb, rows, vocab):
    dev = _dev()
    logits, targets = _ce_inputs(rows, vocab, seed=rows * vocab, device=dev)
    loss64, grad64 = _ce_float64(logits, targets, grad_scale=0.25)
    for variant in ("contiguous", "misaligned", "padded_rows"):
        if variant == "contiguous":
            work = logits.clone()
        elif variant == "misaligned":
            work = _misaligned(logits).view(rows, vocab)
        else:  # row stride vocab + 3: rows are views into a wider buffer
            wide = torch.full((rows, vocab + 3), float("nan"), device=dev)
            wide[:, :vocab] = logits
            work = wide[:, :vocab]
        _poison_allocator(rows * 4 * 4)
        loss = cb.cross_entropy_fwd_bwd(work, targets, grad_scale=0.25)
        assert loss.dtype == torch.float32 and loss.dim() == 0
        _assert_close(loss.double(), loss64, rtol=2e-6, atol=1e-5, what=f"loss {variant}")
        _assert_close(work.double(), grad64, rtol=1e-4, atol=2e-7, what=f"d_logits {variant}")
        if rows > 2:
            assert not work[[1, rows - 1]].any()  # ignored rows: exactly zero
        ref = logits.clone()
        ref_loss = REF.cross_entropy_fwd_bwd(ref, targets, grad_scale=0.25)
        _assert_close(loss, ref_loss, rtol=2e-6, atol=1e-5, what="loss vs torch reference")
        _assert_close(work, ref, rtol=1e-4, atol=2e-7, what="d_logits vs torch reference")


@gpu
@pytest.mark.parametrize("rows,vocab", [(3, 5), (9, 4096), (4, 50257)])
def test_cross_entropy_fwd_leaves_logits_and_matches(cb, rows, vocab):
    dev = _dev()
    logits, targets = _ce_inputs(rows, vocab, seed=5, device=dev)
    targets = targets.to(torch.int32)  # other integer dtypes are accepted
    work = logits.clone()
    loss = cb.cross_entropy_fwd(work, targets)
    assert torch.equal(work, logits)
    loss64, _ = _ce_float64(logits, targets.long(), 1.0)
    _assert_close(loss.double(), loss64, rtol=2e-6, atol=1e-5, what="eval loss")


@gpu
def test_cross_entropy_ignore_index_grad_scale_tensor_and_large_logits(cb):
    dev = _dev()
    logits, targets = _ce_inputs(11, 2053, seed=9, device=dev, scale=30.0)  # large logits: max-shift matters
    targets[targets == -100] = 7
    targets[[0, 4]] = 2052  # a custom ignore_index that is also a valid class id
    loss64, grad64 = _ce_float64(logits, targets, grad_scale=0.5, ignore_index=2052)
    work = logits.clone()
    loss = cb.cross_entropy_fwd_bwd(work, targets, grad_scale=torch.tensor(0.5, device=dev), ignore_index=2052)
    _assert_close(loss.double(), loss64, rtol=2e-6, atol=1e-4, what="loss")
    _assert_close(work.double(), grad64, rtol=1e-4, atol=2e-7, what="d_logits")
    assert not work[[0, 4]].any()


@gpu
def test_cross_entropy_masked_nan_and_bad_targets(cb):
    dev = _dev()
    logits, targets = _ce_inputs(4, 64, seed=13, device=dev)
    targets[:] = torch.tensor([3, 5, 7, 9])
    logits[0, 10:] = float("-inf")  # a masked row: finite loss, zero gradient where masked
    logits[1, 20] = float("nan")
    targets[2] = 64  # out of range and not ignore_index
    per_row = []
    for r in range(4):
        work = logits[r:r + 1].clone()
        per_row.append((cb.cross_entropy_fwd_bwd(work, targets[r:r + 1], grad_scale=1.0), work))
    (l0, g0), (l1, g1), (l2, g2), (l3, _) = per_row
    l0_64, g0_64 = _ce_float64(logits[:1], targets[:1], 1.0)
    _assert_close(l0.double(), l0_64, rtol=2e-6, atol=1e-5, what="masked row")
    assert torch.equal(g0[0, 10:], torch.zeros(54, device=dev))
    assert torch.isnan(l1) and torch.isnan(g1).any()
    assert torch.isnan(l2) and torch.isnan(g2).all()
    assert torch.isfinite(l3)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cross_entropy_refuses_16bit_logits(cb, dtype):
    logits, targets = _ce_inputs(3, 5, seed=17, device=_dev())
    with pytest.raises(AprError, match="float32"):
        cb.cross_entropy_fwd_bwd(logits.to(dtype), targets, grad_scale=1.0)


# ------------------------------------------------------------------------- streams, syncs, DLPack


@gpu
def test_tensors_are_shared_without_copies(cb):
    cupy = pytest.importorskip("cupy")
    t = torch.arange(10, dtype=torch.float32, device=_dev())
    assert cupy.from_dlpack(t).data.ptr == t.data_ptr()


@gpu
def test_no_host_sync_in_any_op(cb):
    dev = _dev()
    n = 4099
    x = _adamw_inputs(n, seed=1, device=dev)
    decay = DecayRanges.from_segments([(100, False), (n - 100, True)])
    logits, targets = _ce_inputs(8, 1000, seed=2, device=dev)
    scale = torch.tensor(0.5, device=dev)
    flag = torch.zeros((), dtype=torch.bool, device=dev)
    copy = torch.empty(n, dtype=torch.bfloat16, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cb.adamw_step(x["param"], x["grad"], x["exp_avg"], x["exp_avg_sq"], step=1, decay=decay, grad_scale=scale,
                      found_inf=flag, param_copy=copy, **HP)
        s = cb.sq_norm(x["param"])
        loss = cb.cross_entropy_fwd_bwd(logits, targets, grad_scale=scale)
        loss2 = cb.cross_entropy_fwd(logits.clone(), targets)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(s).item() and torch.isfinite(loss).item() and torch.isfinite(loss2).item()


@gpu
def test_launches_follow_torchs_current_stream(cb):
    dev = _dev()
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        # produced, reduced and consumed on the side stream with no synchronisation in between:
        # a launch on another stream would race with the fill and usually read garbage
        x = torch.empty(50_000_003, device=dev)
        x.fill_(0.5)
        s = cb.sq_norm(x)
        out = s * 1.0
    torch.cuda.current_stream(dev).wait_stream(side)
    assert out.item() == pytest.approx(0.25 * 50_000_003, rel=1e-6)


@gpu
def test_get_backend_auto_picks_cupy_on_cuda(cb):
    assert get_backend("auto", _dev()).name == "cupy"
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(AprError):
        get_backend("cupy", "cpu")


# ------------------------------------------------------------------------------ the whole engine


def _engine_run(config, device: torch.device, steps: int):
    from apr.train.build import build_engine
    from tests.train.tiny import batches

    engine = build_engine(plan_of(config), device)
    accum = config.training.gradient_accumulation
    data = batches(config, steps * accum, seed=3)
    losses, norms = [], []
    for k in range(steps):
        r = engine.train_step(data[k * accum:(k + 1) * accum], lr=3e-3)
        losses.append(r.loss.item())
        norms.append(r.grad_norm.item())
    weights = {k: v.detach().float().cpu() for k, v in engine.train_state_tensors().items()}
    return engine, losses, norms, weights


def _memorises(engine, steps: int = 10) -> tuple[float, float]:
    """The loss of one batch trained on repeatedly, first and last: it must fall. (Over fresh
    random tokens every step, as in `_engine_run`, there is nothing to learn and it need not.)"""
    from tests.train.tiny import batches

    data = batches(engine.config, engine.config.training.gradient_accumulation, seed=11)
    losses = [engine.train_step(data, lr=3e-3).loss.item() for _ in range(steps)]
    return losses[0], losses[-1]


def _worst_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


ENGINE_CASES = {
    "interleaved_fp32_global": dict(training={"engine": "interleaved", "clip_mode": "global"}),
    "interleaved_fp32_per_block_vocab64": dict(model={"architecture": {"vocab_size": 64}},
                                               training={"engine": "interleaved", "clip_mode": "per_block"}),
    "interleaved_fp32_accum_noclip": dict(training={"engine": "interleaved", "gradient_accumulation": 2,
                                                    "grad_clip": None}),
    "standard_fp32": dict(training={"engine": "standard"}),
}


@gpu
@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_cupy_equals_torch_kernels_on_cuda_and_the_cpu_reference(cb, case):
    from tests.train.tiny import make_config

    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default: fp32 matmuls stay fp32
    sections = ENGINE_CASES[case]
    training = sections.get("training", {})

    def cfg(kernels: str, device: str):
        return make_config(**{**sections, "training": {**training, "kernels": kernels, "device": device}})

    steps = 20
    e_cupy, l_cupy, n_cupy, w_cupy = _engine_run(cfg("cupy", "cuda"), _dev(), steps)
    assert e_cupy.backend.name == "cupy"
    _, l_torch, n_torch, w_torch = _engine_run(cfg("torch", "cuda"), _dev(), steps)
    _, l_cpu, n_cpu, w_cpu = _engine_run(cfg("torch", "cpu"), torch.device("cpu"), steps)
    # same device, same math, only the fused ops differ: rounding-level differences, amplified a
    # little by Adam over 20 steps
    assert l_cupy == pytest.approx(l_torch, rel=1e-5)
    assert n_cupy == pytest.approx(n_torch, rel=1e-4)
    assert _worst_rel(w_cupy, w_torch) <= 1e-4
    # against the CPU reference the matmuls and attention differ too
    assert l_cupy == pytest.approx(l_cpu, rel=1e-4)
    assert _worst_rel(w_cupy, w_cpu) <= 1e-3
    first, last = _memorises(e_cupy)
    assert last < first  # it trains


@gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_cupy_mixed_precision_tracks_torch_kernels(cb, precision):
    from tests.train.tiny import make_config

    def cfg(kernels: str):
        return make_config(model={"architecture": {"vocab_size": 64}},
                           training={"mixed_precision": precision, "kernels": kernels, "device": "cuda"})

    steps = 10
    _, l_cupy, _, w_cupy = _engine_run(cfg("cupy"), _dev(), steps)
    _, l_torch, _, w_torch = _engine_run(cfg("torch"), _dev(), steps)
    assert all(math.isfinite(v) for v in l_cupy)
    assert l_cupy == pytest.approx(l_torch, rel=2e-2)
    assert _worst_rel(w_cupy, w_torch) <= 2e-2


# --------------------------------------------------------------------- backend choice without CUDA


@pytest.fixture
def fresh_kernel_choice(monkeypatch):
    """apr.kernels with nothing tried yet (its CuPy verdict is cached per process)."""
    import apr.kernels as K

    monkeypatch.setattr(K, "_CACHE", {k: v for k, v in K._CACHE.items() if k != "cupy"})
    monkeypatch.setattr(K, "_CUPY_FAILURE", [])
    monkeypatch.setattr(K, "_WARNED", [])
    return K


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")
def test_without_cuda_cupy_is_a_clear_error_and_auto_falls_back(fresh_kernel_choice):
    K = fresh_kernel_choice
    with pytest.raises(AprError, match="cupy"):
        get_backend("cupy", "cuda")
    reason = K.cupy_unavailable_reason()
    assert reason and ("CUDA" in reason or "CuPy" in reason)
    K._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="auto uses the torch kernels"):
        assert K.resolve_backend_name("auto", "cuda") == "torch"
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(AprError, match="CUDA device"):
        get_backend("cupy", "cpu")
    with pytest.raises(AprError, match="unknown kernel backend"):
        get_backend("triton", "cuda")


# --------------------------------------------------------------------------------- CPU twins


def _f32(x) -> np.float32:
    return np.float32(x)


def _fma32(a, b, c) -> np.ndarray:
    """float32 fma via float64 (exact product of two float32s; one final rounding but for rare
    double-rounding cases, far below the tolerances used)."""
    return (np.float64(a) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(np.float32)


def _adamw_twin(p, g, m, v, mask, sc: dict, scale: float):
    """The kernel's per-element arithmetic (adamw.cu, adamw_update) in NumPy float32."""
    g = (g * _f32(scale)).astype(np.float32)
    p = np.where(mask, (p * sc["decay_keep"]).astype(np.float32), p)
    w = sc["one_minus_beta1"]
    m = _fma32(w, g - m, m) if abs(w) < 0.5 else (g - (g - m) * (_f32(1) - w)).astype(np.float32)
    v = _fma32(sc["one_minus_beta2"], (g * g).astype(np.float32), (v * sc["beta2"]).astype(np.float32))
    denom = ((np.sqrt(v) * sc["inv_sqrt_bc2"]).astype(np.float32) + sc["eps"]).astype(np.float32)
    p = _fma32(-sc["step_size"], (m / denom).astype(np.float32), p)
    return p, m, v


def test_adamw_twin_with_the_backends_host_scalars_matches_the_reference():
    n = 1001
    gen = _gen(4)
    decay = DecayRanges.from_segments(_segments(n, gen))
    mask = decay_mask(decay).numpy()
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    tp, tm, tv = p.numpy().copy(), m.numpy().copy(), v.numpy().copy()
    for step in range(1, 8):
        g = torch.randn(n, generator=gen)
        REF.adamw_step(p, g.clone(), m, v, step=step, decay=decay, grad_scale=0.5, **HP)
        sc = dict(zip(ADAMW_SCALARS, adamw_scalars(step=step, **HP), strict=True))
        assert all(isinstance(x, np.float32) for x in sc.values())
        tp, tm, tv = _adamw_twin(tp, g.numpy(), tm, tv, mask, sc, 0.5)
    np.testing.assert_allclose(tp, p.numpy(), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(tm, m.numpy(), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(tv, v.numpy(), rtol=1e-6, atol=1e-15)


def test_adamw_scalars_are_torchs_roundings():
    sc = dict(zip(ADAMW_SCALARS, adamw_scalars(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3),
                  strict=True))
    assert sc["one_minus_beta1"] == np.float32(1 - 0.9) != np.float32(1) - np.float32(0.9)
    assert sc["step_size"] == np.float32(1e-3 / (1 - 0.9**3))
    assert sc["inv_sqrt_bc2"] == np.float32(1) / np.float32(math.sqrt(1 - 0.95**3))
    assert sc["decay_keep"] == np.float32(1 - 1e-3 * 0.1)


_NAN = np.float32("nan")
_NINF = np.float32("-inf")


def _ce_exp(d):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.exp2((np.float32(d) * np.float32(1.4426950408889634)).astype(np.float32)).astype(np.float32)


def _merge(m, s, m2, s2):
    """ce_merge from cross_entropy.cu."""
    mn = np.fmax(m, m2)  # fmaxf drops NaN like np.fmax
    if mn == _NINF:
        return m, (_NAN if (np.isnan(m2) or np.isnan(s2)) else s)
    with np.errstate(invalid="ignore"):
        return mn, np.float32(s * _ce_exp(m - mn) + s2 * _ce_exp(m2 - mn))


def _online_lse_twin(row: np.ndarray, threads: int, vec4: bool) -> np.float32:
    """Pass 1 of the kernel: per-thread online (max, sum) over a strided slice, then the block merge."""
    row = row.astype(np.float32)
    n_vec4 = len(row) // 4 if vec4 else 0
    states = []
    for t in range(threads):
        m, s = _NINF, np.float32(0)
        for i4 in range(t, n_vec4, threads):
            v = row[4 * i4:4 * i4 + 4]
            mn = np.fmax(m, np.fmax(np.fmax(v[0], v[1]), np.fmax(v[2], v[3])))
            if mn == _NINF:
                s = _NAN if np.isnan(v).any() else s
                continue
            with np.errstate(invalid="ignore"):
                s = np.float32(s * _ce_exp(m - mn) + ((_ce_exp(v[0] - mn) + _ce_exp(v[1] - mn))
                                                      + (_ce_exp(v[2] - mn) + _ce_exp(v[3] - mn))))
            m = mn
        for i in range(4 * n_vec4 + t, len(row), threads):
            m, s = _merge(m, s, row[i], np.float32(1))
        states.append((m, s))
    while len(states) > 1:  # the shuffle tree: any pairwise order gives the same math
        states = [_merge(*states[i], *states[i + 1]) if i + 1 < len(states) else states[i]
                  for i in range(0, len(states), 2)]
    m, s = states[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(np.log(s) + m)


@pytest.mark.parametrize("vocab,threads,vec4", [(1, 32, False), (5, 32, False), (37, 32, False), (64, 32, True),
                                                (1000, 64, True), (4099, 128, False)])
def test_online_softmax_twin_matches_logsumexp(vocab, threads, vec4):
    row = (torch.randn(vocab, generator=_gen(vocab)) * 8).numpy()
    expect = torch.logsumexp(torch.from_numpy(row).double(), 0).item()
    assert _online_lse_twin(row, threads, vec4) == pytest.approx(expect, rel=2e-6, abs=1e-5)


def test_online_softmax_twin_nan_and_inf_rules():
    row = np.full(64, -np.inf, np.float32)
    row[[5, 40]] = [1.0, 2.0]  # a masked row
    assert _online_lse_twin(row, 32, True) == pytest.approx(math.log(math.e + math.e**2), rel=1e-6)
    row_nan = row.copy()
    row_nan[7] = np.nan  # NaN where every other element of its thread's slice is -inf
    assert np.isnan(_online_lse_twin(row_nan, 32, True))
    assert np.isnan(_online_lse_twin(row_nan, 32, False))
    assert np.isneginf(_online_lse_twin(np.full(8, -np.inf, np.float32), 32, False))


def test_two_stage_norm_twin_matches_the_reference():
    x = (torch.randn(100_003, generator=_gen(8)) * 5)
    blocks, threads = 37, 256
    stride = blocks * threads
    sq = (x.numpy() * x.numpy()).astype(np.float32).astype(np.float64)  # square in float32, sum in double
    partials = [sum(sq[t::stride].sum() for t in range(b * threads, (b + 1) * threads)) for b in range(blocks)]
    twin = np.float32(sum(partials))
    assert twin == pytest.approx((x.double() ** 2).sum().item(), rel=2e-7)  # one float32 rounding at the end
    assert twin == pytest.approx(REF.sq_norm(x).item(), rel=1e-5)  # the reference accumulates in float32


# ------------------------------------------------------------- the real kernels, emulated on the CPU
#
# The .cu sources compiled by g++ for the host with a small prelude: the threads of a block are
# fibers (ucontext) run in turn by one OS thread, blocks one after another; __syncthreads switches
# to the scheduler, so the whole block meets there; a warp shuffle is an exchange through a slot
# array between two barriers (stricter than a warp: it also synchronises the block); __shared__
# is static storage.
# The backend's own Python code (grids, alignment choices, argument lists) drives them through
# ``EmulatedBackend``: its arguments are packed the way CuPy packs them (a pointer per tensor,
# numpy scalars by their size) and checked against each kernel's parameter sizes and kinds, so an
# argument-order or type slip fails here instead of as garbage on the first GPU run.

EMU_PRELUDE = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>
#include <type_traits>
#include <ucontext.h>
#include <utility>

#define APR_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;

// Each CUDA thread of a block is a fiber (ucontext) run by one OS thread; a barrier switches back to
// the scheduler, which resumes every fiber in turn: the whole block meets at each barrier.
static const size_t APR_EMU_STACK = 64 * 1024;
static ucontext_t apr_emu_sched;
static ucontext_t apr_emu_ctx[1024];
static bool apr_emu_done[1024];
static char* apr_emu_stacks = nullptr;
static int apr_emu_cur = 0;
static std::function<void()> apr_emu_body;
alignas(16) static double apr_emu_slots[1024];

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int i; std::memcpy(&i, &f, 4); return i; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline void __syncthreads() { swapcontext(&apr_emu_ctx[apr_emu_cur], &apr_emu_sched); }
template <class T> inline T __shfl_xor_sync(unsigned int, T v, int off) {
    static_assert(sizeof(T) <= sizeof(double), "slot size");
    T* slots = reinterpret_cast<T*>(apr_emu_slots);
    slots[threadIdx.x] = v;
    __syncthreads();
    T r = slots[threadIdx.x ^ (unsigned int)off];
    __syncthreads();
    return r;
}
inline unsigned short apr_f32_to_f16_bits(float f) {
    _Float16 h = (_Float16)f; unsigned short b; std::memcpy(&b, &h, 2); return b;
}
inline float apr_f16_bits_to_f32(unsigned short b) { _Float16 h; std::memcpy(&h, &b, 2); return (float)h; }

static void apr_emu_entry() {
    apr_emu_body();
    apr_emu_done[apr_emu_cur] = true;  // returning resumes uc_link: the scheduler
}

template <class T> constexpr int apr_emu_code() {  // size * 10 + kind: 1 pointer, 2 floating, 3 integer
    return (int)sizeof(T) * 10 + (std::is_pointer_v<T> ? 1 : std::is_floating_point_v<T> ? 2 : 3);
}
template <class... A, std::size_t... I>
void apr_emu_call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}
template <class... A> void apr_emu_launch(void (*k)(A...), int grid, int block, void** args) {
    if (apr_emu_stacks == nullptr) apr_emu_stacks = static_cast<char*>(std::malloc(1024 * APR_EMU_STACK));
    gridDim.x = grid;
    blockDim.x = block;
    apr_emu_body = [=] { apr_emu_call(k, args, std::index_sequence_for<A...>{}); };
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < block; ++t) {
            getcontext(&apr_emu_ctx[t]);
            apr_emu_ctx[t].uc_stack.ss_sp = apr_emu_stacks + (size_t)t * APR_EMU_STACK;
            apr_emu_ctx[t].uc_stack.ss_size = APR_EMU_STACK;
            apr_emu_ctx[t].uc_link = &apr_emu_sched;
            makecontext(&apr_emu_ctx[t], apr_emu_entry, 0);
            apr_emu_done[t] = false;
        }
        for (bool live = true; live;) {
            live = false;
            for (int t = 0; t < block; ++t) {
                if (apr_emu_done[t]) continue;
                apr_emu_cur = t;
                threadIdx.x = t;
                swapcontext(&apr_emu_sched, &apr_emu_ctx[t]);
                live = live || !apr_emu_done[t];
            }
        }
    }
}
template <class... A> int apr_emu_signature(void (*)(A...), int* codes) {
    int i = 0;
    ((codes[i++] = apr_emu_code<std::remove_cv_t<A>>()), ...);
    return i;
}
#define APR_EMU_EXPORT(NAME)                                                                      \
    extern "C" void emu_##NAME(int grid, int block, void** args) { apr_emu_launch(&NAME, grid, block, args); } \
    extern "C" int sig_##NAME(int* codes) { return apr_emu_signature(&NAME, codes); }
"""

_EMU_FLAGS = ["-std=c++20", "-O2", "-ffp-contract=off", "-shared", "-fPIC"]


@pytest.fixture(scope="module")
def emu_libs(tmp_path_factory):
    """{kernel name: ctypes library} for the host-compiled kernels (skips without a C++20 g++)."""
    import ctypes
    import shutil
    import subprocess

    from apr.kernels.cupy_backend import KERNEL_FILES, KERNEL_NAMES, kernel_source

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not on the PATH")
    out = tmp_path_factory.mktemp("cuda_emu")
    probe = out / "probe.cpp"
    probe.write_text(EMU_PRELUDE + "int apr_probe() { return (int)apr_f16_bits_to_f32(0x3c00); }\n")
    proc = subprocess.run([cxx, *_EMU_FLAGS, str(probe), "-o", str(out / "probe.so")], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"this g++ cannot build the emulation prelude (C++20, ucontext, _Float16): {proc.stderr[:300]}")
    libs = {}
    for file in KERNEL_FILES:
        src = out / f"{file}.cpp"
        exports = "".join(f"APR_EMU_EXPORT({fn})\n" for fn in KERNEL_NAMES[file])
        src.write_text(EMU_PRELUDE + kernel_source(file) + "\n" + exports)
        lib_path = out / f"{file}.so"
        proc = subprocess.run([cxx, *_EMU_FLAGS, str(src), "-o", str(lib_path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{file}.cu does not build for the host emulation:\n{proc.stderr[-4000:]}"
        lib = ctypes.CDLL(str(lib_path))
        for fn in KERNEL_NAMES[file]:
            libs[fn] = lib
    return libs


class EmulatedBackend:
    """Built lazily from CupyBackend so this module imports without CuPy."""

    @staticmethod
    def make(libs, sm_count: int = 2):
        from apr.kernels.cupy_backend import CupyBackend

        class _Emu(CupyBackend):
            device_type = "cpu"

            def __init__(self):  # no CuPy, no CUDA: the kernels are host functions in `libs`
                import threading

                self._lock = threading.Lock()
                self._sm_count = {0: sm_count}
                self._decay_tables = {}
                self.launches: list[tuple[str, int, int]] = []

            def _ready(self, device):
                return 0

            def _launch(self, device, name, grid, block, args):
                _emu_launch(libs[name], name, grid, block, args)
                self.launches.append((name, grid, block))

        return _Emu()


def _emu_launch(lib, name: str, grid: int, block: int, args: tuple) -> None:
    import ctypes

    assert 1 <= block <= 1024 and block % 32 == 0 and grid >= 1, (name, grid, block)
    codes = (ctypes.c_int * 64)()
    n_params = getattr(lib, f"sig_{name}")(codes)
    holders, got = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            assert a.device.type == "cpu"
            holders.append(ctypes.c_void_p(a.data_ptr()))
            got.append(81)
        elif isinstance(a, np.uint64):  # a null pointer
            holders.append(ctypes.c_void_p(int(a) or None))
            got.append(81)
        elif isinstance(a, np.int32):
            holders.append(ctypes.c_int32(int(a)))
            got.append(43)
        elif isinstance(a, np.int64):
            holders.append(ctypes.c_int64(int(a)))
            got.append(83)
        elif isinstance(a, np.float32):
            holders.append(ctypes.c_float(float(a)))
            got.append(42)
        else:  # CuPy would pass a Python int as int64 and a float as double: never what a kernel wants
            raise AssertionError(f"{name}: argument {a!r} of type {type(a).__name__} is not a sized scalar")
    assert got == list(codes[:n_params]), f"{name}: arguments {got} vs parameters {list(codes[:n_params])}"
    argv = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    getattr(lib, f"emu_{name}")(grid, block, argv)


@pytest.fixture(scope="module")
def emu(emu_libs):
    return EmulatedBackend.make(emu_libs)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 1000, 4099, 70_001])
@pytest.mark.parametrize("aligned", [True, False])
def test_emulated_adamw_matches_the_reference(emu, n, aligned):
    x = _adamw_inputs(n, seed=n, device="cpu")
    decay = DecayRanges.from_segments(_segments(n, _gen(n + 1)))
    ours = {k: (v.clone() if aligned else _misaligned(v)) for k, v in x.items()}
    ref = _clone(x)
    for step in (1, 2, 7):
        grad = torch.randn(n, generator=_gen(100 * step + n))
        ours["grad"].copy_(grad)
        emu.adamw_step(ours["param"], ours["grad"], ours["exp_avg"], ours["exp_avg_sq"], step=step, decay=decay,
                       grad_scale=0.75, **HP)
        REF.adamw_step(ref["param"], grad.clone(), ref["exp_avg"], ref["exp_avg_sq"], step=step, decay=decay,
                       grad_scale=0.75, **HP)
    for k in ("param", "exp_avg", "exp_avg_sq"):
        _assert_close(ours[k], ref[k], rtol=2e-6, atol=1e-7, what=k)
    assert torch.equal(ours["grad"], grad)


def test_emulated_adamw_device_scalars_flags_and_compute_copies(emu):
    n = 1031
    x = _adamw_inputs(n, seed=2, device="cpu")
    decay = DecayRanges.from_segments([(7, False), (1000, True), (24, False)])
    ref = _clone(x)
    REF.adamw_step(ref["param"], ref["grad"], ref["exp_avg"], ref["exp_avg_sq"], step=1, decay=decay,
                   grad_scale=torch.tensor(0.3), **HP)
    for flag_dtype in (torch.bool, torch.uint8, torch.float32):
        skipped = _clone(x)
        copy = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        emu.adamw_step(skipped["param"], skipped["grad"], skipped["exp_avg"], skipped["exp_avg_sq"], step=1,
                       decay=decay, grad_scale=torch.tensor(0.3), found_inf=torch.ones((), dtype=flag_dtype),
                       param_copy=copy, **HP)
        assert all(torch.equal(skipped[k], x[k]) for k in ("param", "exp_avg", "exp_avg_sq"))
        assert torch.isnan(copy.float()).all()
    for dtype, offset in ((torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 1), (torch.float16, 3)):
        ours = _clone(x)
        copy = torch.full((n + offset,), float("nan"), dtype=dtype)[offset:]
        emu.adamw_step(ours["param"], ours["grad"], ours["exp_avg"], ours["exp_avg_sq"], step=1, decay=decay,
                       grad_scale=torch.tensor(0.3), found_inf=torch.zeros((), dtype=torch.bool), param_copy=copy,
                       **HP)
        _assert_close(ours["param"], ref["param"], rtol=2e-6, atol=1e-7, what="param")
        assert torch.equal(copy, ours["param"].to(dtype)), (dtype, offset)
    assert {name for name, _, _ in emu.launches} >= {"apr_adamw_f32_copy_bf16", "apr_adamw_f32_copy_f16"}


@pytest.mark.parametrize("n", [0, 1, 3, 5, 1023, 4097, 300_007])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_emulated_sq_norm_matches_float64(emu, n, dtype):
    x = (torch.randn(n, generator=_gen(n)) * 3).to(dtype)
    exact = (x.double() ** 2).sum()
    for t in (x, _misaligned(x)):
        s = emu.sq_norm(t)
        assert s.dtype == torch.float32 and s.dim() == 0
        _assert_close(s.double(), exact, rtol=2e-7, atol=1e-30, what=f"sq_norm n={n}")
    if n > 5:
        y = x.clone()
        y[n // 2] = float("inf")
        assert not torch.isfinite(emu.sq_norm(y))


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 5), (7, 37), (5, 1000), (3, 4099), (2, 32768), (2, 50257)])
def test_emulated_cross_entropy_matches_float64(emu, rows, vocab):
    logits, targets = _ce_inputs(rows, vocab, seed=rows + vocab, device="cpu", scale=8.0)
    loss64, grad64 = _ce_float64(logits, targets, grad_scale=0.25)
    wide = torch.full((rows, vocab + 3), float("nan"))
    wide[:, :vocab] = logits
    for variant, work in (("contiguous", logits.clone()), ("misaligned", _misaligned(logits).view(rows, vocab)),
                          ("padded_rows", wide[:, :vocab])):
        loss = emu.cross_entropy_fwd_bwd(work, targets, grad_scale=torch.tensor(0.25))
        _assert_close(loss.double(), loss64, rtol=2e-6, atol=1e-5, what=f"loss {variant}")
        _assert_close(work.double(), grad64, rtol=1e-4, atol=2e-7, what=f"d_logits {variant}")
        if rows > 2:
            assert not work[[1, rows - 1]].any()
    assert torch.isnan(wide[:, vocab:]).all()  # the padding was never written
    fresh = logits.clone()
    _assert_close(emu.cross_entropy_fwd(fresh, targets).double(), loss64, rtol=2e-6, atol=1e-5, what="fwd")
    assert torch.equal(fresh, logits)


def test_emulated_cross_entropy_special_rows_and_float32_only(emu):
    logits, targets = _ce_inputs(4, 64, seed=13, device="cpu")
    targets[:] = torch.tensor([3, 5, 7, 9])
    logits[0, 10:] = float("-inf")
    logits[1, 20] = float("nan")
    targets[2] = 64
    work = logits.clone()
    loss_rows = [emu.cross_entropy_fwd_bwd(work[r:r + 1], targets[r:r + 1], grad_scale=1.0) for r in range(4)]
    l0_64, g0_64 = _ce_float64(logits[:1], targets[:1], 1.0)
    _assert_close(loss_rows[0].double(), l0_64, rtol=2e-6, atol=1e-5, what="masked row")
    _assert_close(work[:1].double(), g0_64, rtol=1e-4, atol=2e-7, what="masked row grad")
    assert torch.isnan(loss_rows[1]) and torch.isnan(work[1]).any()
    assert torch.isnan(loss_rows[2]) and torch.isnan(work[2]).all()
    assert torch.isfinite(loss_rows[3])
    for dtype in (torch.bfloat16, torch.float16):  # the engine always passes float32 logits (linear_ce.py)
        lg, tg = _ce_inputs(5, 64, seed=1, device="cpu")
        with pytest.raises(AprError, match="float32"):
            emu.cross_entropy_fwd_bwd(lg.to(dtype), tg, grad_scale=1.0)


def test_emulated_cross_entropy_hands_out_each_positions_loss_for_blame(emu):
    """``position_losses`` (apr runs blame): the kernel's own per-position losses, the loss and the
    gradient unchanged; through the chunked head, each row's summed loss."""
    from apr.kernels.linear_ce import capture_row_losses, linear_cross_entropy_fwd_bwd

    logits, targets = _ce_inputs(7, 37, seed=5, device="cpu", scale=8.0)  # rows 1 and 6 ignored
    plain, given = logits.clone(), logits.clone()
    positions = torch.full((7,), float("nan"))
    loss = emu.cross_entropy_fwd_bwd(plain, targets, grad_scale=0.5)
    assert torch.equal(emu.cross_entropy_fwd_bwd(given, targets, grad_scale=0.5, position_losses=positions), loss)
    assert torch.equal(plain, given)
    ref = F.cross_entropy(logits.double(), targets, reduction="none")  # 0 where ignored
    _assert_close(positions.double(), ref, rtol=2e-6, atol=1e-5, what="position losses")
    assert positions[1] == 0 and positions[6] == 0
    with pytest.raises(AprError, match=r"position_losses must be float32 \[7\]"):
        emu.cross_entropy_fwd_bwd(logits.clone(), targets, grad_scale=1.0, position_losses=torch.empty(6))
    hidden, weight = torch.randn(2, 5, 8, generator=_gen(1)), torch.randn(37, 8, generator=_gen(2))
    ids = torch.randint(0, 37, (2, 5), generator=_gen(3))
    with capture_row_losses() as rows:
        linear_cross_entropy_fwd_bwd(hidden, weight, ids, chunk_size=2, grad_scale=1.0, backend=emu)
    per_row = F.cross_entropy((hidden @ weight.t()).reshape(-1, 37).double(), ids.reshape(-1), reduction="none")
    _assert_close(rows[0].double(), per_row.view(2, 5).sum(dim=1), rtol=1e-5, atol=1e-5, what="row sums")


@pytest.mark.parametrize("engine,precision", [("interleaved", "fp32"), ("standard", "fp32"), ("interleaved", "fp16")])
def test_emulated_kernels_train_the_engine_like_the_reference(emu, engine, precision):
    from apr.train.build import build_engine
    from tests.train.tiny import batches, make_config

    config = make_config(model={"architecture": {"vocab_size": 64}},
                         training={"engine": engine, "mixed_precision": precision})
    data = batches(config, 4, seed=1)
    runs = []
    for backend in (emu, REF):
        eng = build_engine(plan_of(config), "cpu", backend=backend)
        losses = [eng.train_step([b], lr=3e-3).loss.item() for b in data]
        runs.append((losses, {k: v.detach().clone() for k, v in eng.train_state_tensors().items()}))
    (l_emu, w_emu), (l_ref, w_ref) = runs
    # fp32: rounding-level differences (measured 6e-6 at worst). fp16: the float32 d_logits are
    # rounded to fp16, where a last-bit difference is 1e-3 relative (measured 1.1e-3 in the moments).
    loss_rel, state_rel = (1e-5, 1e-4) if precision == "fp32" else (1e-4, 3e-3)
    assert l_emu == pytest.approx(l_ref, rel=loss_rel)
    assert max(((w_emu[k] - w_ref[k]).norm() / w_ref[k].norm().clamp_min(1e-30)).item() for k in w_ref) <= state_rel


# ----------------------------------------------------------------- bf16 state, stochastic rounding


def _bf16_state(n: int, seed: int, device) -> list[torch.Tensor]:
    g = _gen(seed)
    return [t.bfloat16().to(device) for t in (torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
                                              torch.rand(n, generator=g) * 0.01)]


def _bf16_kernel_against_the_reference(backend, device, n: int, grad_dtype: torch.dtype) -> None:
    """Decay alone (zero gradient and moments) gives a float32 result both compute bitwise, so the
    stored bits test the noise itself element by element; then a real update: every element within
    one bf16 step of the reference, nearly all equal (the float32 updates differ by an ulp at most)."""
    decay = DecayRanges.from_segments([(n // 3, False), (n - n // 3, True)])
    keys = (0x12345678, 0x9ABCDEF0, 0xFFFFFFFF)
    param = torch.randn(n, generator=_gen(n)).bfloat16().to(device)
    zeros = [torch.zeros(n, dtype=torch.bfloat16, device=device) for _ in range(2)]
    ours, ref = [param.clone(), *(z.clone() for z in zeros)], [param.clone(), *(z.clone() for z in zeros)]
    backend.adamw_step(ours[0], torch.zeros(n, dtype=grad_dtype, device=device), ours[1], ours[2], step=1,
                       decay=decay, rounding=keys, lr=0.3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.07)
    REF.adamw_step(ref[0], torch.zeros(n, dtype=grad_dtype, device=device), ref[1], ref[2], step=1, decay=decay,
                   rounding=keys, lr=0.3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.07)
    assert torch.equal(ours[0].view(torch.int16), ref[0].view(torch.int16))
    assert not torch.equal(ours[0], param)  # the decay moved them
    ours, ref = _bf16_state(n, seed=n + 1, device=device), _bf16_state(n, seed=n + 1, device=device)
    for step in (1, 2, 5):
        grad = torch.randn(n, generator=_gen(step)).to(device=device, dtype=grad_dtype)
        backend.adamw_step(ours[0], grad.clone(), ours[1], ours[2], step=step, decay=decay, rounding=keys,
                           grad_scale=0.5, **HP)
        REF.adamw_step(ref[0], grad.clone(), ref[1], ref[2], step=step, decay=decay, rounding=keys, grad_scale=0.5,
                       **HP)
    for a, b, what in zip(ours, ref, ("param", "exp_avg", "exp_avg_sq"), strict=True):
        steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        assert int(steps.max()) <= 1, what
        assert float((steps == 0).float().mean()) > 0.99, what


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 4099])
def test_emulated_bf16_state_kernel_rounds_as_the_reference(emu, n, grad_dtype):
    _bf16_kernel_against_the_reference(emu, "cpu", n, grad_dtype)
    flagged = _bf16_state(n, seed=3, device="cpu")
    before = [t.clone() for t in flagged]
    emu.adamw_step(flagged[0], torch.randn(n).to(grad_dtype), flagged[1], flagged[2], step=1,
                   decay=DecayRanges.from_segments([(n, True)]), rounding=(1, 2, 3),
                   found_inf=torch.ones((), dtype=torch.bool), **HP)
    assert all(torch.equal(a, b) for a, b in zip(flagged, before, strict=True))
    with pytest.raises(AprError, match="rounding keys"):
        emu.adamw_step(*flagged[:1], torch.randn(n), *flagged[1:], step=1, decay=DecayRanges.from_segments([(n, True)]),
                       **HP)
    expect = "apr_adamw_bf16_sr_grad_bf16" if grad_dtype == torch.bfloat16 else "apr_adamw_bf16_sr"
    assert expect in {name for name, _, _ in emu.launches}


@gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4099, (1 << 20) + 3])
def test_bf16_state_kernel_rounds_as_the_reference(cb, n, grad_dtype):
    _bf16_kernel_against_the_reference(cb, _dev(), n, grad_dtype)
