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
    ) -> None:
        # The reference may read the flag on the host; device backends skip on the device instead.
        if found_inf is not None and bool(found_inf.item()):
            return
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            grad.mul_(grad_scale)
        if weight_decay != 0.0:
            keep = 1 - lr * weight_decay
            for s, e in decay.ranges:
                param[s:e].mul_(keep)
        # The same op sequence as torch.optim.AdamW's single-tensor path, so results match bitwise.
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    def sq_norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        return torch.linalg.vector_norm(x32).square()

    def cross_entropy_fwd_bwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, grad_scale: float, ignore_index: int = -100
    ) -> torch.Tensor:
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, 0)
        lse = torch.logsumexp(logits, dim=-1)
        target_logit = logits.gather(1, safe_targets[:, None]).squeeze(1)
        loss_sum = torch.where(valid, lse - target_logit, 0.0).sum()
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
