"""The reference backend: the fused ops written as plain torch tensor ops. Runs on any device; the
CuPy backend is tested against it."""

from __future__ import annotations

import torch

from apr.kernels.interface import DecayRanges, KernelBackend


class TorchBackend(KernelBackend):
    name = "torch"

    def adamw_step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: int,
        decay: DecayRanges,
        grad_scale: torch.Tensor | float = 1.0,
        found_inf: torch.Tensor | None = None,
        param_copy: torch.Tensor | None = None,
        rounding: tuple[int, int, int] | None = None,
    ) -> None:
        if param.dtype == torch.bfloat16:
            self._adamw_bf16_state(param, grad, exp_avg, exp_avg_sq, rounding, param_copy, lr=lr, beta1=beta1,
                                   beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, decay=decay,
                                   grad_scale=grad_scale, found_inf=found_inf)
            return
        if found_inf is None:
            if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
                grad.mul_(grad_scale)
            if weight_decay != 0.0:
                keep = 1 - lr * weight_decay
                for s, e in decay.ranges:
                    param[s:e].mul_(keep)
            # The same op sequence as torch.optim.AdamW's single-tensor path, so results match bitwise.
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            param.addcdiv_(exp_avg, _denom(exp_avg_sq, beta2, step, eps), value=-lr / (1 - beta1**step))
        else:
            _masked_adamw(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, decay,
                          grad_scale, found_inf)
        if param_copy is not None:
            param_copy.copy_(param)

    def _adamw_bf16_state(self, param, grad, exp_avg, exp_avg_sq, rounding, param_copy, **update) -> None:
        """bf16 weights and moments: the float32 update on their float32 values, each written back with
        stochastic rounding (``KernelBackend.adamw_step``)."""
        if rounding is None or exp_avg.dtype != torch.bfloat16 or exp_avg_sq.dtype != torch.bfloat16:
            raise ValueError("adamw_step on bf16 state needs bf16 weights and moments and the rounding keys, got "
                             f"{param.dtype}/{exp_avg.dtype}/{exp_avg_sq.dtype}, rounding={rounding}")
        p32, m32, v32 = param.float(), exp_avg.float(), exp_avg_sq.float()
        self.adamw_step(p32, grad.float() if grad.dtype != torch.float32 else grad, m32, v32, **update)
        for exact, stored, key in zip((p32, m32, v32), (param, exp_avg, exp_avg_sq), rounding, strict=True):
            stored.copy_(stochastic_round_bf16(exact, key))
        if param_copy is not None:
            param_copy.copy_(param)

    def sq_norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        return torch.linalg.vector_norm(x32).square()

    fills_position_losses = True  # cross_entropy_fwd_bwd's position_losses: free (apr runs blame)

    def cross_entropy_fwd_bwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, grad_scale: float, ignore_index: int = -100,
        position_losses: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_losses`` (float32 ``[n]``, optional): filled with each position's loss, the
        values the sum is taken over (the loss is the same with or without it)."""
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)
        lse = torch.logsumexp(logits, dim=-1)
        target_logit = logits.gather(1, safe_targets[:, None]).squeeze(1)
        per_position = torch.where(valid, lse - target_logit, 0.0)
        if position_losses is not None:
            position_losses.copy_(per_position)
        loss_sum = per_position.sum()
        # d/dlogits of sum(lse - logit[target]) = softmax - onehot, in place over the logits.
        logits.sub_(lse[:, None]).exp_()
        logits.scatter_add_(1, safe_targets[:, None], torch.full_like(lse[:, None], -1.0))
        logits.mul_((valid.to(logits.dtype) * grad_scale)[:, None])
        return loss_sum

    def cross_entropy_fwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
    ) -> torch.Tensor:
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)
        lse = torch.logsumexp(logits, dim=-1)
        target_logit = logits.gather(1, safe_targets[:, None]).squeeze(1)
        return torch.where(valid, lse - target_logit, 0.0).sum()


_MASK32 = (1 << 32) - 1


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding uint32 values (products wrap mod 2**64;
    their low 32 bits are the uint32 product)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def stochastic_round_bf16(x: torch.Tensor, key: int) -> torch.Tensor:
    """A flat float32 tensor rounded to bfloat16 stochastically: element ``i`` gets the noise
    ``fmix32(i ^ key) >> 16`` (the high half of index ``i``, when there is one, hashed in again)
    added to its bits, then its low 16 bits are dropped; ``kernels/adamw.cu`` draws the same bits."""
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    h = _fmix32((idx & _MASK32) ^ key)
    if x.numel() > _MASK32 + 1:
        hi = idx >> 32
        h = torch.where(hi != 0, _fmix32((h + hi) & _MASK32), h)
    bits = x.contiguous().view(torch.int32) + (h >> 16).to(torch.int32)
    return (bits >> 16).to(torch.int16).view(torch.bfloat16)


def _denom(exp_avg_sq: torch.Tensor, beta2: float, step: int, eps: float) -> torch.Tensor:
    return (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)


def _masked_adamw(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, decay, grad_scale,
                  found_inf: torch.Tensor) -> None:
    """AdamW that leaves param and moments unchanged where the device flag ``found_inf`` is set,
    without reading it on the host. Unflagged, every element is the unmasked path's bit for bit:
    the flag only selects the scalars (0-dim tensors of the same float32 values) and, last, the
    parameter; flagged, the gradient is zeroed so the moments' updates are exact no-ops
    (lerp by 0, multiply by 1, add 0)."""
    found = found_inf.reshape(()).to(torch.bool)
    one = torch.ones((), dtype=param.dtype, device=param.device)

    def pick(value: float) -> torch.Tensor:  # the scalar, or 1 (no change) on a flagged step
        return torch.where(found, one, torch.full((), value, dtype=param.dtype, device=param.device))

    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        grad.mul_(grad_scale)
    zero = torch.zeros_like(one)
    torch.where(found, zero, grad, out=grad)  # NaN/inf gradients must not reach the moments
    if weight_decay != 0.0:
        keep = pick(1 - lr * weight_decay)
        for s, e in decay.ranges:
            param[s:e].mul_(keep)
    exp_avg.lerp_(grad, torch.where(found, zero, torch.full_like(one, 1 - beta1)))
    exp_avg_sq.mul_(pick(beta2)).addcmul_(grad, grad, value=1 - beta2)
    # the new parameter overwrites the denominator (a temporary), then is taken on an unflagged step only
    denom = _denom(exp_avg_sq, beta2, step, eps)
    torch.addcdiv(param, exp_avg, denom, value=-lr / (1 - beta1**step), out=denom)
    torch.where(found, param, denom, out=param)
