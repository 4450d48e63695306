"""Backpropagation from an intermediate tensor with a given gradient, as ``out.backward(grad)`` does,
without autograd's Python-side argument checks: torch's ``_make_grads`` imports its symbolic-shape
module (and sympy) the first time a gradient tensor is passed, about a second of every training
process's start (docs/design.md §21, "Backpropagating a block"). The engine's walk always passes a
gradient of the output's own shape, dtype and device; anything else goes through torch's checks."""

from __future__ import annotations

import torch
from torch.autograd import graph


def backward(out: torch.Tensor, grad: torch.Tensor, retain_graph: bool = False) -> None:
    """Accumulate into the leaves' ``.grad`` the gradient ``grad`` of ``out``: bitwise what
    ``out.backward(grad, retain_graph=retain_graph)`` gives."""
    run = getattr(graph, "_engine_run_backward", None)
    plain = (type(out) is torch.Tensor and type(grad) is torch.Tensor and out.shape == grad.shape
             and out.dtype == grad.dtype and out.device == grad.device and not out.is_nested)
    if run is None or not plain:
        out.backward(grad, retain_graph=retain_graph)
        return
    run((out,), (grad,), retain_graph, False, (), allow_unreachable=True, accumulate_grad=True)
