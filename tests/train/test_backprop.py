"""apr.train.backprop.backward: the engine's walk backpropagates a block from its output's gradient
exactly as ``out.backward(grad)`` does, and a gradient torch would refuse is still refused."""

from __future__ import annotations

import pytest
import torch

from apr.train.backprop import backward


def _block(seed: int):
    torch.manual_seed(seed)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    return w, x, torch.tanh(x @ w) * 1.5


def test_the_gradients_are_bitwise_those_of_tensor_backward():
    w1, x1, out1 = _block(0)
    w2, x2, out2 = _block(0)
    grad = torch.randn(4, 8)
    out1.backward(grad, retain_graph=True)
    backward(out2, grad, retain_graph=True)
    assert torch.equal(w1.grad, w2.grad) and torch.equal(x1.grad, x2.grad)
    # the kept graph backpropagates again and accumulates, as torch's does
    out1.backward(grad)
    backward(out2, grad)
    assert torch.equal(w1.grad, w2.grad) and torch.equal(x1.grad, x2.grad)
    with pytest.raises(RuntimeError, match="second time"):  # the graph is freed without retain_graph
        backward(out2, grad)


def test_a_gradient_of_another_shape_is_refused_as_torch_refuses_it():
    _, _, out = _block(1)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        backward(out, torch.randn(2, 8))
