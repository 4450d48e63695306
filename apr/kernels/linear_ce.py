"""LM head + cross-entropy over sequence chunks (docs/design.md, "Kernels").

For each chunk of ``chunk_size`` positions: logits = h_chunk @ W^T in float32 (``[batch, chunk,
vocab]``, the only logits that ever exist), then the backend's fused cross-entropy turns them into
the loss sum and, in place, d_logits; d_logits gives the chunk's hidden gradient and adds into the
head weight's gradient. The full ``[batch, seq, vocab]`` logits are never built.
"""

from __future__ import annotations

import contextlib

import torch

from apr.kernels import get_backend
from apr.kernels.interface import KernelBackend


def _compute_dtype(device: torch.device, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


# ``capture_row_losses``: where each training loss call adds its rows' summed cross-entropy (None: off)
_row_sink: list[torch.Tensor] | None = None


@contextlib.contextmanager
def capture_row_losses():
    """Inside, every training loss over the head (``linear_cross_entropy_fwd_bwd``, and the
    differentiable ``linear_cross_entropy``, which calls it) appends to the yielded list one float32
    tensor ``[batch]`` on the device: each row's cross-entropy summed over its positions, with the
    same formula as the torch backend's: handed out by the backend, which computes them for the sum
    anyway (torch and CuPy), else taken from the chunk's logits before the backend overwrites them
    with their gradient (one more logsumexp); the loss and the gradients are untouched. For ``apr runs
    blame`` (apr/train/blame.py), which captures every training step (a step may turn out to be the
    one a run stops at) and records the logged ones."""
    global _row_sink
    outer, _row_sink = _row_sink, []
    try:
        yield _row_sink
    finally:
        _row_sink = outer


def _position_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Each position's cross-entropy (0 where ignored), float32, without touching ``logits``."""
    valid = targets != ignore_index
    picked = logits.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    return torch.where(valid, torch.logsumexp(logits, dim=-1) - picked, 0.0)


def _fwd_bwd_with_positions(backend: KernelBackend, logits: torch.Tensor, targets: torch.Tensor, grad_scale: float,
                            positions: torch.Tensor) -> torch.Tensor:
    """The backend's fused cross-entropy of a chunk, each position's loss written to ``positions``:
    handed out by a backend that computes them anyway (``fills_position_losses``: torch and CuPy),
    else computed from the logits before the backend overwrites them (one more logsumexp)."""
    if getattr(backend, "fills_position_losses", False):
        return backend.cross_entropy_fwd_bwd(logits, targets, grad_scale=grad_scale, position_losses=positions)
    positions.copy_(_position_losses(logits, targets))
    return backend.cross_entropy_fwd_bwd(logits, targets, grad_scale=grad_scale)


def _row_sums(positions: torch.Tensor, batch: int, seq: int, chunk_size: int) -> torch.Tensor:
    """Each row's summed loss from the positions' losses, laid out chunk after chunk (each chunk
    ``[batch, chunk length]``): two reductions for the whole call, none per chunk."""
    whole = seq // chunk_size * chunk_size
    rows = positions[: batch * whole].view(-1, batch, chunk_size).sum(dim=(0, 2))
    if whole < seq:
        rows += positions[batch * whole:].view(batch, seq - whole).sum(dim=1)
    return rows


def _chunks(seq_len: int, chunk_size: int):
    for start in range(0, seq_len, chunk_size):
        yield start, min(start + chunk_size, seq_len)


def linear_cross_entropy_fwd_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    grad_scale: float,
    backend: KernelBackend,
    grad_weight: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum and gradients of ``grad_scale * loss_sum`` over ``hidden`` ``[batch, seq, h]``
    (final-normed) and the head ``weight`` ``[vocab, h]``.

    Returns ``(loss_sum, grad_hidden)`` with ``grad_hidden`` in ``hidden``'s dtype. The weight's
    gradient is added into ``grad_weight`` (float32, ``weight``'s shape) when one is given.
    """
    hidden = hidden.detach()
    b, s, h = hidden.shape
    cdt = _compute_dtype(hidden.device, compute_dtype)
    w = weight.detach().to(cdt)
    grad_hidden = torch.empty_like(hidden)
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    positions = None if _row_sink is None else torch.empty(b * s, dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start, end in _chunks(s, chunk_size):
            h_chunk = hidden[:, start:end].reshape(-1, h).to(cdt)
            logits = (h_chunk @ w.t()).float()
            t_chunk = targets[:, start:end].reshape(-1)
            if positions is None:
                loss_sum += backend.cross_entropy_fwd_bwd(logits, t_chunk, grad_scale=grad_scale)
            else:
                loss_sum += _fwd_bwd_with_positions(backend, logits, t_chunk, grad_scale, positions[b * start:b * end])
            d_logits = logits.to(cdt)
            grad_hidden[:, start:end] = (d_logits @ w).view(b, end - start, h).to(hidden.dtype)
            if grad_weight is not None:
                if cdt == torch.float32:
                    grad_weight.addmm_(d_logits.t(), h_chunk)
                else:
                    grad_weight.add_(d_logits.t() @ h_chunk)
    if positions is not None and _row_sink is not None:
        _row_sink.append(_row_sums(positions, b, s, chunk_size))
    return loss_sum, grad_hidden


@torch.no_grad()
def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    backend: KernelBackend,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Summed cross-entropy without gradients (validation), chunked the same way."""
    b, s, h = hidden.shape
    cdt = _compute_dtype(hidden.device, compute_dtype)
    w = weight.to(cdt)
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start, end in _chunks(s, chunk_size):
            logits = (hidden[:, start:end].reshape(-1, h).to(cdt) @ w.t()).float()
            loss_sum += backend.cross_entropy_fwd(logits, targets[:, start:end].reshape(-1))
    return loss_sum


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean chunked cross-entropy for ordinary autograd (the standard engine, ``model(ids, targets)``).

    The forward already computes both gradients, chunk by chunk, and keeps them (``[batch, seq, h]``
    and ``[vocab, h]``) instead of the logits; backward only scales them.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, backend, compute_dtype):
        count = targets.numel()  # pretraining: every position is a target (no host sync to count)
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return linear_cross_entropy_sum(
                hidden, weight, targets, chunk_size=chunk_size, backend=backend, compute_dtype=compute_dtype
            ) / count
        # a frozen head (LoRA) needs no weight gradient: none is formed or kept
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        loss_sum, grad_hidden = linear_cross_entropy_fwd_bwd(
            hidden, weight, targets, chunk_size=chunk_size, grad_scale=1.0 / count, backend=backend,
            grad_weight=grad_weight, compute_dtype=compute_dtype,
        )
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_loss.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
        gw = grad_weight * grad_loss.to(grad_weight.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    backend: KernelBackend | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` over every position of ``targets``,
    differentiable, computed over sequence chunks."""
    if backend is None:

        backend = get_backend("torch")
    cdt = _compute_dtype(hidden.device, compute_dtype)
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk_size, backend, cdt)
