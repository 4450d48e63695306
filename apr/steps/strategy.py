"""How an optimizer step is carried out for a config: which gradients are kept, whether the
interleaved engine needs a norm-only pre-pass, what clipping is in force. Torch-free: the plan shows
``describe()``; the engine and ``apr.memory.buffers.buffer_plan`` act on it.

Costs, for the interleaved engine (forward F, a block's recompute + backward ~ 3F):
- no clipping, or ``per_block``: one backward walk, each block's AdamW right after its backward;
  O(one block) gradient memory, no extra compute.
- ``global`` with gradient accumulation > 1: every group's gradient is kept across micro-batches
  anyway, so the exact global norm is known before any update: free.
- ``global`` (or fp16 loss scaling, which needs the overflow check before any update) without
  accumulation: a norm-only backward walk first (gradients reduced to one squared norm per group
  and dropped), then the stepping walk; the block inputs are kept between the walks so the forward
  is not repeated. Memory stays O(one block); compute grows by one backward walk (~ +75% step
  time: 1 + 3 + 3 = 7F instead of 4F).
"""

from __future__ import annotations

from dataclasses import dataclass

from apr.steps.execution import from_config, gradient_source, keeps_all_grads, needs_prepass, prepass_reasons


@dataclass(frozen=True)
class StepStrategy:
    engine: str  # "interleaved" | "standard"
    clip: str  # "global" | "per_block" | "adagc" | "off"
    keeps_all_grads: bool  # every group's gradient lives for the whole step
    norm_prepass: bool  # interleaved: a norm-only backward walk before the stepping walk
    loss_scaling: bool  # fp16 dynamic loss scaling
    prepass_for: tuple[str, ...] = ()  # what needs the norm before the first update (see describe)

    @property
    def backward_walks(self) -> int:
        return 2 if self.norm_prepass else 1

    def describe(self) -> str:
        clip = {"global": "exact global-norm clipping", "per_block": "per-block clipping",
                "adagc": "AdaGC per-tensor clipping", "off": "no clipping"}[self.clip]
        if self.engine == "standard":
            how = "standard engine: full backward, then torch AdamW; all gradients held"
        elif self.keeps_all_grads:
            how = "interleaved engine; every gradient kept for the step (global norm is free)"
        elif self.norm_prepass:
            why = " and the ".join(self.prepass_for) or "global norm"
            how = f"interleaved engine; norm-only backward pre-pass for the {why} (+1 backward walk)"
        else:
            how = "interleaved engine; AdamW per block right after its backward (one block of gradients)"
        return f"{clip}; {how}"


def step_strategy(config, execution=None) -> StepStrategy:
    """The strategy for an ``AprConfig`` under a resolved ``apr.steps.execution.Execution`` (default:
    the config's, ``auto`` as if memory were unlimited)."""

    tr = config.training
    clip = "off" if tr.grad_clip is None else str(tr.clip_mode)
    execution = execution or from_config(config)
    return StepStrategy(gradient_source(config), clip, keeps_all_grads(config, execution),
                        needs_prepass(config, execution), str(tr.mixed_precision) == "fp16",
                        tuple(prepass_reasons(config)))
