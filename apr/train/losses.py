"""The loss parts of the composed engine (docs/design.md, "The composed engine").

A loss part maps a micro-batch to the scalar the gradient source differentiates, on either
autograd source (one process, DDP or FSDP2 shards: under FSDP2 it runs inside the root module's
forward, so the embedding and head are gathered while it reads them). ``CausalLM`` is the
pretraining loss through the model's one loss entry point (``LlamaForCausalLM.loss``); the
distillation losses live in ``apr/train/distill.py``. The flat-buffer walk fuses the causal-LM
loss into its head step (``linear_cross_entropy_fwd_bwd``) and takes only ``CausalLM``.

The protocol: ``begin_step(step)`` before the step's micro-batches, ``__call__(engine, lm, ids,
targets)`` per micro-batch, ``lr_factor(loss)`` once the step's update is decided (a loss may
scale its step's LR, as distillation's autotune does), ``state_dict``/``load_state_dict`` for the
checkpoint's engine metadata.
"""

from __future__ import annotations

import torch


class CausalLM:
    """Mean next-token cross-entropy over the micro-batch."""

    kind: str | None = None  # None: the engine keeps its own kind in checkpoints
    per_param_steps = False  # every parameter takes every update

    def begin_step(self, step: int) -> None:
        pass

    def __call__(self, engine, lm, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with engine.autocast():
            hidden = engine.hidden_states(lm, ids)
        return lm.loss(hidden, targets, chunk_size=engine.chunk_size, backend=engine.backend,
                       compute_dtype=engine.cdt, norm_context=engine.autocast())

    def lr_factor(self, loss: torch.Tensor) -> float:
        return 1.0

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass
