"""Time steps of time conditioning (``model.architecture.time``; apr/model/time.py), torch-free: the
step of a time, of a stacking stage, and the step a model runs at outside training. The plan and the
model ask the same functions."""

from __future__ import annotations

import math

from apr.config.schema import AprConfig, TimeConditioning

DEFAULT_EVAL_TIME = 0.5  # input: validation, apr eval and apr generate at the middle of [0, 1]


def step_of(time: float, n: int) -> int:
    """The time step of a time ``t`` in ``[0, 1]``: ``min(floor(t x n), n - 1)``."""
    return min(int(math.floor(time * n)), n - 1)


def stage_step(t: TimeConditioning, stage: int) -> int:
    """Time-as-depth: stacking stage ``stage``'s (0-based) step, linear ``k x time_per_stack`` or
    exponential ``(2^k - 1) x time_per_stack``, at most ``num_time_steps - 1``."""
    k = stage if str(t.stack_time_mapping or "linear") == "linear" else 2 ** stage - 1
    return min(k * t.time_per_stack, t.num_time_steps - 1)


def fixed_step_of(config: AprConfig) -> int:
    """The step the model runs at outside training: ``eval_time``'s (input) or, for depth, the stage of
    ``config`` (a stacked config as the engine builds it: its last stage is the current one)."""
    t = config.model.architecture.time
    if str(t.interpretation) == "depth":
        return stage_step(t, len(config.model.stacking.stages) - 1)
    return step_of(DEFAULT_EVAL_TIME if t.eval_time is None else t.eval_time, t.num_time_steps)
