"""Chunked LM head + cross-entropy against the full-logits computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apr.kernels.linear_ce import linear_cross_entropy, linear_cross_entropy_fwd_bwd, linear_cross_entropy_sum
from apr.kernels.torch_backend import TorchBackend

B = TorchBackend()


def _data(seed=0, b=3, s=10, h=8, v=29):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, h, generator=gen), torch.randn(v, h, generator=gen) * 0.3,
            torch.randint(0, v, (b, s), generator=gen))


def test_fwd_bwd_equals_full_logits_autograd_for_every_chunking():
    hidden, weight, targets = _data()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_ref = F.cross_entropy((h_ref @ w_ref.t()).reshape(-1, 29), targets.reshape(-1), reduction="sum")
    (loss_ref * 0.1).backward()
    for chunk in (1, 3, 10, 50):
        gw = torch.zeros_like(weight)
        loss, gh = linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=chunk, grad_scale=0.1,
                                                backend=B, grad_weight=gw)
        assert torch.allclose(loss, loss_ref, rtol=1e-6)
        assert torch.allclose(gh, h_ref.grad, atol=1e-6)
        assert torch.allclose(gw, w_ref.grad, atol=1e-6)
        assert torch.allclose(linear_cross_entropy_sum(hidden, weight, targets, chunk_size=chunk, backend=B),
                              loss_ref, rtol=1e-6)


def test_grad_weight_accumulates_into_the_given_buffer():
    hidden, weight, targets = _data(1)
    gw = torch.ones_like(weight)
    once = torch.zeros_like(weight)
    linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=4, grad_scale=1.0, backend=B, grad_weight=once)
    linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=4, grad_scale=1.0, backend=B, grad_weight=gw)
    assert torch.allclose(gw, once + 1.0)


def test_autograd_function_mean_loss_and_backward_scaling():
    hidden, weight, targets = _data(2)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h1 @ w1.t()).reshape(-1, 29), targets.reshape(-1))
    (3.0 * ref).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h2, w2, targets, chunk_size=4, backend=B)
    (3.0 * loss).backward()
    assert torch.allclose(loss, ref, rtol=1e-6)
    assert torch.allclose(h2.grad, h1.grad, atol=1e-6) and torch.allclose(w2.grad, w1.grad, atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(linear_cross_entropy(hidden, weight, targets, chunk_size=7), ref, rtol=1e-6)


def test_bf16_compute_keeps_float32_logits_and_gradients():
    hidden, weight, targets = _data(3)
    gw = torch.zeros_like(weight)
    loss, gh = linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=4, grad_scale=1.0, backend=B,
                                            grad_weight=gw, compute_dtype=torch.bfloat16)
    ref = F.cross_entropy((hidden @ weight.t()).reshape(-1, 29), targets.reshape(-1), reduction="sum")
    assert gw.dtype == torch.float32 and gh.dtype == hidden.dtype
    assert torch.allclose(loss, ref, rtol=2e-2)


class _NoPositions(TorchBackend):
    """A backend that does not hand out position losses (torch and CuPy do): captured from the logits."""

    fills_position_losses = False


def test_captured_row_losses_are_each_rows_cross_entropy_and_change_nothing_else():
    from apr.kernels.linear_ce import capture_row_losses

    hidden, weight, targets = _data(seed=4)
    per_row = F.cross_entropy((hidden @ weight.t()).reshape(-1, 29), targets.reshape(-1),
                              reduction="none").view(3, 10).sum(dim=1)
    plain_gw = torch.zeros_like(weight)
    plain = linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=3, grad_scale=0.1, backend=B,
                                         grad_weight=plain_gw)
    for backend in (B, _NoPositions()):
        gw = torch.zeros_like(weight)
        with capture_row_losses() as rows:
            loss, gh = linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=3, grad_scale=0.1,
                                                    backend=backend, grad_weight=gw)
            linear_cross_entropy_sum(hidden, weight, targets, chunk_size=3, backend=backend)  # evaluation: not captured
        assert len(rows) == 1 and torch.allclose(rows[0], per_row, rtol=1e-5)
        assert torch.equal(loss, plain[0]) and torch.equal(gh, plain[1]) and torch.equal(gw, plain_gw)  # bitwise
    linear_cross_entropy_fwd_bwd(hidden, weight, targets, chunk_size=3, grad_scale=0.1, backend=B)
    assert rows == [rows[0]]  # outside the context nothing more is captured
