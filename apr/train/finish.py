"""The one step finisher (docs/design.md, "The composed engine"): how every optimizer step of every
gradient source ends. ``Engine.train_step`` (apr/train/engine.py) is the only step; it asks its
gradient source for gradients in one of two shapes, by the step strategy (apr/steps/strategy.py):

* every group's squared norm known before any update (``known``): autograd on any layout, the walk's
  kept gradients (accumulation) and its norm-only pre-pass (exact global clipping, fp16): the global
  norm, the non-finite / fp16-overflow decision, the bad-step gate, the clipping coefficients (the
  one dispatch of ``training.clip_mode``: ``Engine._coefs``), then the source applies the update;
* streamed (``stream_coef`` per group as its gradient completes, ``stream_end`` after the last): the
  walk's single backward with per-block, AdaGC or no clipping, each group updated inside the backward.

Norms are of the gradients as the source holds them: scaled by the fp16 loss scale for the walks
(``sq_scale``), unscaled for autograd. A source that reads the host anyway (autograd: the textbook
loop) stops at a non-finite norm at once; the walks flag it on the device (``Engine._flags``) and the
run reads the flag when it reads the host."""

from __future__ import annotations

from collections.abc import Callable

import torch

from apr.train.nonfinite import GRADIENTS
from apr.train.outcome import NonFiniteError, StepResult


def begin(engine) -> None:
    """What every step starts with, on every source."""
    engine.calls += 1
    engine._skip = False
    engine._flags.start_step()
    engine.loss.begin_step(engine.current_step)


def clip_(engine, local: dict[str, list[torch.Tensor]], coefs: dict) -> None:
    """Clip autograd's (unscaled) group gradients in place: by each group's coefficient (``global``,
    ``per_block``: ``Engine._coefs``), or per tensor (AdaGC; a rank's shards under FSDP2:
    ``engine.tensor_norms`` all-reduces the per-tensor norms then)."""
    clip = engine.strategy.clip
    if clip == "adagc":
        for name, grads in local.items():
            engine._adagc_clip(name, grads, norms=engine.tensor_norms(grads, name))
    elif clip != "off":
        for name, grads in local.items():
            torch._foreach_mul_(grads, coefs[name])


def _norm(engine, sq: dict[str, torch.Tensor], sq_scale: float) -> torch.Tensor:
    """The global norm from the groups' squared norms, summed in the engine's group order (then any
    group of the loss part's own), so every source sums in the same order."""
    order = [n for n in engine.group_names if n in sq] + [n for n in sq if n not in engine.group_names]
    return torch.stack([sq[n] for n in order]).sum().sqrt() / sq_scale


def known(engine, loss: torch.Tensor, sq: dict[str, torch.Tensor], apply: Callable[[dict], None], *,
          sq_scale: float, host: bool) -> StepResult:
    """Every group's squared norm is known before any update: the non-finite check (on the host when
    ``host`` or under fp16, whose overflow skips the step; else a device flag), the gate, then
    ``apply(coefs)`` with each group's clipping coefficient."""
    engine._keep_sq(sq, sq_scale)
    norm = _norm(engine, sq, sq_scale)
    if host or engine.scaler.enabled:
        if not bool(torch.isfinite(norm).item()):
            if engine.scaler.enabled:  # fp16 overflow: every rank sees the same (reduced) norm
                engine.scaler.update(found_inf=True)
                return StepResult(loss, norm, skipped=True)
            raise NonFiniteError("gradients", state_is_last_good=True)
    else:
        engine._flags.flag(~torch.isfinite(norm), GRADIENTS, engine.calls)
    if engine._gate(loss, norm):
        return StepResult(loss, norm, flagged=True)
    apply(engine._coefs(sq, norm, sq_scale=sq_scale))
    engine._stepped()
    return StepResult(loss, norm)


def stream_coef(engine, sq: torch.Tensor) -> float | torch.Tensor | None:
    """A streamed group's clipping coefficient from its squared norm (None: the loss test flagged the
    step, so no group updates); a non-finite gradient is flagged (the groups updated before it make
    the state partial)."""
    if engine._skip:
        return None
    coef = engine._clip_coef(sq.sqrt()) if engine.strategy.clip == "per_block" else 1.0
    engine._flags.flag(~torch.isfinite(sq), GRADIENTS, engine.calls)
    return coef


def stream_end(engine, loss: torch.Tensor, sq: dict[str, torch.Tensor]) -> StepResult:
    """After a streamed step's last group: the norm it had (for the log) and the step's count."""
    engine._keep_sq(sq)
    norm = _norm(engine, sq, 1.0)
    if engine._skip:
        return StepResult(loss, norm, flagged=True)
    engine._stepped()
    return StepResult(loss, norm)
