"""apr/train/updaters.py: the updater part of the composed engine. Its two ways of updating (the
kernel backend's fused AdamW on flat tensors; torch's AdamW over named parameters) are the same
AdamW, a frozen parameter is left alone, and adopted moments continue the bias correction."""

from __future__ import annotations

import torch

from apr.config.schema import OptimizerConfig
from apr.kernels import get_backend
from apr.kernels.interface import DecayRanges
from apr.train.updaters import AdamW

OPT = OptimizerConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _grads(steps: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)) for _ in range(steps)]


def test_the_flat_update_and_torch_adamw_agree():
    """A matrix that decays and a vector that does not, 3 steps: the fused flat update of their
    concatenation equals torch's AdamW over the two tensors."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    grads = _grads(3, gen)
    named = {"w": torch.nn.Parameter(w.clone()), "b": torch.nn.Parameter(b.clone())}
    torch_up = AdamW(OPT, get_backend("torch", "cpu"))
    torch_up.bind(named, {"w"}, torch.device("cpu"))
    flat_up = AdamW(OPT, get_backend("torch", "cpu"))
    flat = torch.cat([w.reshape(-1), b])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    decay = DecayRanges.from_segments([(w.numel(), True), (b.numel(), False)])
    for step, (gw, gb) in enumerate(grads, start=1):
        named["w"].grad, named["b"].grad = gw.clone(), gb.clone()
        torch_up.step(OPT.lr)
        flat_up.update_flat(flat, torch.cat([gw.reshape(-1), gb]), m, v, lr=OPT.lr, step=step, decay=decay)
    torch.testing.assert_close(flat, torch.cat([named["w"].detach().reshape(-1), named["b"].detach()]),
                               rtol=1e-6, atol=1e-7)
    tm, tv = torch_up.moments(named["w"])
    torch.testing.assert_close(m[: w.numel()], tm.reshape(-1), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(v[: w.numel()], tv.reshape(-1), rtol=1e-6, atol=1e-10)


def test_a_frozen_parameter_keeps_its_weights_and_moments():
    gen = torch.Generator().manual_seed(1)
    named = {name: torch.nn.Parameter(torch.randn(3, generator=gen)) for name in ("a", "b")}
    up = AdamW(OPT, get_backend("torch", "cpu"))
    up.bind(named, {"a", "b"}, torch.device("cpu"))
    for p in named.values():
        p.grad = torch.randn(3, generator=gen)
    up.step(OPT.lr)
    frozen = named["a"].detach().clone(), *(t.clone() for t in up.moments(named["a"]))
    up.freeze([named["a"]])
    for p in named.values():
        p.grad = torch.randn(3, generator=gen)
    before_b = named["b"].detach().clone()
    up.step(OPT.lr)
    assert torch.equal(named["a"].detach(), frozen[0])
    assert all(torch.equal(x, y) for x, y in zip(up.moments(named["a"]), frozen[1:], strict=True))
    assert not torch.equal(named["b"].detach(), before_b)


def test_adopted_moments_continue_as_the_uninterrupted_update():
    """Resume: moments and the step count set on a fresh updater make its next step the one the
    uninterrupted updater takes (the bias correction continues from the adopted step)."""
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(3)]
    p = torch.nn.Parameter(start.clone())
    up = AdamW(OPT, get_backend("torch", "cpu"))
    up.bind({"p": p}, {"p"}, torch.device("cpu"))
    for g in grads[:2]:
        p.grad = g.clone()
        up.step(OPT.lr)
    saved = p.detach().clone(), *(t.clone() for t in up.moments(p))
    assert up.steps_of(p) == 2
    p.grad = grads[2].clone()
    up.step(OPT.lr)

    q = torch.nn.Parameter(saved[0].clone())
    resumed = AdamW(OPT, get_backend("torch", "cpu"))
    resumed.bind({"q": q}, {"q"}, torch.device("cpu"))
    resumed.set_moments(q, saved[1].clone(), saved[2].clone(), 2)
    q.grad = grads[2].clone()
    resumed.step(OPT.lr)
    assert torch.equal(q.detach(), p.detach())
