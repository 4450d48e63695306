"""The one routine that finishes an autograd step (docs/design.md, "The composed engine"): the
global norm from the groups' squared norms, the non-finite / fp16-overflow decision, the bad-step
gate, clipping (global, per_block or AdaGC, dispatched once here), the LR the loss part asks for and
the optimizer's update. Every autograd gradient source (one process, DDP, FSDP2 shards) and every
loss (causal LM, distillation) ends its step here; the flat-buffer walk decides the same things
inside its walk with the same engine helpers (``Engine._coefs``, ``Engine._adagc_clip``)."""

from __future__ import annotations

import torch

from apr.train.outcome import NonFiniteError, StepResult


def clip_(engine, local: dict[str, list[torch.Tensor]], sq: dict[str, torch.Tensor], norm: torch.Tensor) -> None:
    """Clip the groups' gradients in place by ``training.clip_mode``. ``local``: each live group's
    gradient tensors (a rank's shards under FSDP2: ``engine.tensor_norms`` all-reduces AdaGC's
    per-tensor norms then); ``sq``: every group's squared norm, already unscaled."""
    clip = engine.strategy.clip
    if clip == "adagc":
        for name, grads in local.items():
            engine._adagc_clip(name, grads, norms=engine.tensor_norms(grads))
        return
    if clip == "off":
        return
    coefs = engine._coefs(sq, norm, sq_scale=1.0)
    for name, grads in local.items():
        torch._foreach_mul_(grads, coefs[name])


def finish_step(engine, loss: torch.Tensor, local: dict[str, list[torch.Tensor]], sq: dict[str, torch.Tensor],
                lr: float) -> StepResult:
    """Norm, non-finite check, gate, clip, update; ``sq`` in the engine's group order."""
    engine._keep_sq(sq)
    norm = torch.stack(list(sq.values())).sum().sqrt()
    if not bool(torch.isfinite(norm).item()):
        if engine.scaler.enabled:  # fp16 overflow: every rank sees the same (all-reduced) norm
            engine.scaler.update(found_inf=True)
            return StepResult(loss, norm, skipped=True)
        raise NonFiniteError("gradients", state_is_last_good=True)
    if engine._gate(loss, norm):
        return StepResult(loss, norm, flagged=True)
    clip_(engine, local, sq, norm)
    engine.updater.step(lr * engine.loss.lr_factor(loss))
    engine.optimizer_steps += 1
    engine.scaler.update(found_inf=False)
    return StepResult(loss, norm)
