"""The reference backend against torch's own AdamW, norms and cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apr.errors import AprError
from apr.kernels import DecayRanges, get_backend
from apr.kernels.torch_backend import TorchBackend

B = TorchBackend()


def test_decay_ranges_merge_adjacent_segments():
    d = DecayRanges.from_segments([(3, False), (4, True), (2, True), (1, False), (5, True)])
    assert d.numel == 15
    assert d.ranges == ((3, 9), (10, 15))
    assert d.decayed_numel == 11


def test_adamw_matches_torch_adamw_bitwise_and_skips_norms_for_decay():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5,), (7, 3), (4,), (2, 9)]  # norm, matrix, norm, matrix
    decays = [False, True, False, True]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in tensors]
    opt = torch.optim.AdamW(
        [{"params": [p for p, d in zip(ref, decays, strict=True) if d], "weight_decay": 0.1},
         {"params": [p for p, d in zip(ref, decays, strict=True) if not d], "weight_decay": 0.0}],
        lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )
    flat = torch.cat([t.reshape(-1) for t in tensors])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    decay = DecayRanges.from_segments([(t.numel(), d) for t, d in zip(tensors, decays, strict=True)])
    for step in range(1, 6):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        B.adamw_step(flat, torch.cat([g.reshape(-1) for g in grads]), m, v, lr=0.01, beta1=0.9, beta2=0.95,
                     eps=1e-8, weight_decay=0.1, step=step, decay=decay)
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in ref]))


def test_adamw_decay_touches_only_decayed_ranges():
    flat = torch.ones(10)
    decay = DecayRanges.from_segments([(4, False), (6, True)])
    B.adamw_step(flat, torch.zeros(10), torch.zeros(10), torch.zeros(10), lr=0.5, beta1=0.9, beta2=0.99,
                 eps=1e-8, weight_decay=0.2, step=1, decay=decay)
    assert flat[:4].tolist() == [1.0] * 4
    assert torch.allclose(flat[4:], torch.full((6,), 0.9))


def test_adamw_grad_scale_and_found_inf():
    gen = torch.Generator().manual_seed(1)
    p0, g = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    kw = dict(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1,
              decay=DecayRanges.from_segments([(8, True)]))
    a, ma, va = p0.clone(), torch.zeros(8), torch.zeros(8)
    B.adamw_step(a, g * 0.25, ma, va, **kw)
    b, mb, vb = p0.clone(), torch.zeros(8), torch.zeros(8)
    B.adamw_step(b, g.clone(), mb, vb, grad_scale=torch.tensor(0.25), **kw)
    assert torch.equal(a, b) and torch.equal(ma, mb) and torch.equal(va, vb)
    c, mc, vc = p0.clone(), torch.zeros(8), torch.zeros(8)
    B.adamw_step(c, torch.full((8,), float("nan")), mc, vc, found_inf=torch.tensor(True), **kw)
    assert torch.equal(c, p0) and not mc.any() and not vc.any()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_adamw_with_a_clear_found_inf_is_bitwise_the_unmasked_update(weight_decay, grad_scale):
    """The device-flag path (no host read) must not change a good step by one bit, and a flagged
    step with NaN/inf gradients leaves parameters and moments exactly as they were."""
    gen = torch.Generator().manual_seed(3)
    n = 1001
    p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    v0, g = torch.rand(n, generator=gen) * 0.01, torch.randn(n, generator=gen)
    decay = DecayRanges.from_segments([(100, False), (800, True), (101, False)])
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=weight_decay, step=7, decay=decay)
    scale = torch.tensor(grad_scale)
    ref = [t.clone() for t in (p0, m0, v0)]
    B.adamw_step(ref[0], g.clone(), ref[1], ref[2], grad_scale=scale, **kw)
    out = [t.clone() for t in (p0, m0, v0)]
    B.adamw_step(out[0], g.clone(), out[1], out[2], grad_scale=scale, found_inf=torch.tensor(False), **kw)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    bad = g.clone()
    bad[[3, 500]] = torch.tensor([float("nan"), float("inf")])
    kept = [t.clone() for t in (p0, m0, v0)]
    B.adamw_step(kept[0], bad, kept[1], kept[2], grad_scale=scale, found_inf=torch.tensor(1.0), **kw)
    assert all(torch.equal(a, b) for a, b in zip(kept, (p0, m0, v0), strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adamw_writes_the_compute_copy(dtype):
    gen = torch.Generator().manual_seed(4)
    p, g = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    kw = dict(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1,
              decay=DecayRanges.from_segments([(64, True)]))
    copy = torch.zeros(64, dtype=dtype)
    B.adamw_step(p, g.clone(), torch.zeros(64), torch.zeros(64), param_copy=copy, **kw)
    assert torch.equal(copy, p.to(dtype))
    before = copy.clone()
    B.adamw_step(p, g.clone(), torch.zeros(64), torch.zeros(64), param_copy=copy, found_inf=torch.tensor(True), **kw)
    assert torch.equal(copy, before)


def test_sq_norm_is_a_device_tensor_and_flags_non_finite():
    x = torch.tensor([3.0, 4.0, 0.0])
    s = B.sq_norm(x)
    assert isinstance(s, torch.Tensor) and s.dim() == 0 and s.item() == pytest.approx(25.0)
    assert B.sq_norm(x.to(torch.bfloat16)).dtype == torch.float32
    assert not torch.isfinite(B.sq_norm(torch.tensor([1.0, float("inf")])))


def test_cross_entropy_fwd_bwd_matches_autograd_with_ignore_index():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(11, 37, generator=gen) * 3
    targets = torch.randint(0, 37, (11,), generator=gen)
    targets[[2, 7]] = -100
    ref = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref, targets, ignore_index=-100, reduction="sum")
    (loss_ref * 0.5).backward()
    work = logits.clone()
    loss = B.cross_entropy_fwd_bwd(work, targets, grad_scale=0.5)
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    assert torch.allclose(work, ref.grad, atol=1e-7)
    assert not work[[2, 7]].any()
    assert torch.allclose(B.cross_entropy_fwd(logits.clone(), targets), loss_ref, rtol=1e-6)


def test_get_backend_resolution():
    assert get_backend("auto", "cpu").name == "torch"
    assert get_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(AprError):
        get_backend("cupy", "cpu")
    with pytest.raises(AprError):
        get_backend("triton", "cpu")


def test_a_rows_cross_entropy_does_not_depend_on_the_other_rows():
    """Data-parallel ranks see a slice of the rows one process sees: each row's loss and gradient must
    be the same bits either way (tests/distributed/ pins the ranks to one process at 1e-6)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(96, 2048, generator=gen) * 4
    targets = torch.randint(0, 2048, (96,), generator=gen)
    targets[[3, 50]] = -100
    whole = logits.clone()
    B.cross_entropy_fwd_bwd(whole, targets, grad_scale=0.25)
    for rows in (slice(0, 48), slice(48, 96), slice(5, 6), slice(17, 80)):
        part = logits[rows].clone()
        B.cross_entropy_fwd_bwd(part, targets[rows], grad_scale=0.25)
        assert torch.equal(part, whole[rows])


# ------------------------------------------------------------------ bf16 state, stochastic rounding


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above (in magnitude) each float32 value."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    up = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    return down, torch.where((x.view(torch.int32) & 65535) == 0, down, up)


def test_stochastic_rounding_is_unbiased_keyed_and_exact_on_bf16_values():
    from apr.kernels.interface import rounding_keys
    from apr.kernels.torch_backend import stochastic_round_bf16

    x = torch.full((20_000,), 1.0 + 2.0**-9)  # a quarter of the way from 1.0 to the next bf16 (1 + 2**-7)
    rounded = stochastic_round_bf16(x, rounding_keys(3, 1, "block.0")[0]).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(rounded.mean()) - float(x[0])) < 2e-4  # the expectation is the float32 value
    assert abs(float((rounded > 1).float().mean()) - 0.25) < 0.02
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(5000, generator=gen) * 1e-3
    key = rounding_keys(11, 7, "head")[1]
    a, b = stochastic_round_bf16(y, key), stochastic_round_bf16(y, key)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # a function of (key, index) only
    other = stochastic_round_bf16(y, rounding_keys(11, 8, "head")[1])
    assert not torch.equal(a.view(torch.int16), other.view(torch.int16))
    down, up = _bf16_neighbours(y)
    assert bool(((a.float() == down) | (a.float() == up)).all())
    exact = y.to(torch.bfloat16)
    assert torch.equal(stochastic_round_bf16(exact.float(), key), exact)  # a bf16 value stays itself
    assert len(set(rounding_keys(11, 7, "head"))) == 3 and rounding_keys(11, 7, "head") != rounding_keys(11, 7, "embed")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bf16_state_adamw_is_the_float32_update_stochastically_rounded(grad_dtype):
    """Each stored value is one of the two bf16 neighbours of the float32 AdamW update of the stored
    values; a flagged step changes nothing; the same keys give the same bits."""
    gen = torch.Generator().manual_seed(1)
    n, kw = 4099, dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3,
                       decay=DecayRanges.from_segments([(99, False), (4000, True)]))
    state = [torch.randn(n, generator=gen).bfloat16(), (torch.randn(n, generator=gen) * 0.1).bfloat16(),
             (torch.rand(n, generator=gen) * 0.01).bfloat16()]
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    exact = [t.float() for t in state]
    B.adamw_step(*exact[:1], grad.float().clone(), *exact[1:], grad_scale=0.5, **kw)
    keys = (1, 2, 3)
    ours = [t.clone() for t in state]
    B.adamw_step(ours[0], grad.clone(), ours[1], ours[2], grad_scale=0.5, rounding=keys, **kw)
    for got, want in zip(ours, exact, strict=True):
        assert got.dtype == torch.bfloat16
        down, up = _bf16_neighbours(want)
        assert bool(((got.float() == down) | (got.float() == up)).all())
    again = [t.clone() for t in state]
    B.adamw_step(again[0], grad.clone(), again[1], again[2], grad_scale=0.5, rounding=keys, **kw)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ours, again, strict=True))
    skipped = [t.clone() for t in state]
    B.adamw_step(skipped[0], torch.full((n,), float("nan")).to(grad_dtype), skipped[1], skipped[2], rounding=keys,
                 found_inf=torch.tensor(True), **kw)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(skipped, state, strict=True))
    with pytest.raises(ValueError, match="rounding keys"):
        B.adamw_step(state[0].clone(), grad.clone(), state[1].clone(), state[2].clone(), **kw)


def test_updates_below_half_a_bf16_ulp_survive_on_average():
    """Round to nearest would leave weights of 1.0 at 1.0 under updates of 1/8 of an ulp; stochastic
    rounding moves them by that much on average."""
    n, lr = 20_000, 2.0**-10  # AdamW's first step moves each weight by about lr; a bf16 ulp at 1.0 is 2**-7
    param = torch.ones(n, dtype=torch.bfloat16)
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    B.adamw_step(param, torch.ones(n), m, v, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1,
                 decay=DecayRanges.from_segments([(n, False)]), rounding=(5, 6, 7))
    assert abs(float(param.float().mean()) - (1 - lr)) < 2e-4
    assert torch.equal(torch.ones(n).add_(-lr).to(torch.bfloat16), torch.ones(n, dtype=torch.bfloat16))
