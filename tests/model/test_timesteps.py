"""The steps of time conditioning (apr/model/timesteps.py): of a time, of a stacking stage, and the
step a model runs at outside training."""

from __future__ import annotations

from apr.config.schema import TimeConditioning
from apr.model.timesteps import fixed_step_of, stage_step, step_of
from tests.train.tiny import make_config


def test_a_time_is_the_step_of_its_share_of_the_steps_and_a_stage_its_mapped_step():
    assert [step_of(t, 10) for t in (0.0, 0.099, 0.1, 0.5, 0.999, 1.0)] == [0, 0, 1, 5, 9, 9]
    linear = TimeConditioning(embedding_dim=4, num_time_steps=10, interpretation="depth", time_per_stack=3)
    exponential = linear.model_copy(update={"stack_time_mapping": "exponential"})
    assert [stage_step(linear, k) for k in range(5)] == [0, 3, 6, 9, 9]  # k x 3, at most 9
    assert [stage_step(exponential, k) for k in range(4)] == [0, 3, 9, 9]  # (2^k - 1) x 3, at most 9


def test_outside_training_a_model_runs_at_eval_times_step_or_its_stages():
    assert fixed_step_of(make_config(model={"architecture": {"time": {"embedding_dim": 4}}})) == 500
    assert fixed_step_of(make_config(model={"architecture": {"time": {"embedding_dim": 4, "eval_time": 1.0}}})) == 999
    depth = {"embedding_dim": 4, "interpretation": "depth", "time_per_stack": 7, "stack_time_mapping": "exponential"}
    stages = [{"blocks": 1, "steps": 2}, {"blocks": 2, "steps": 2}, {"blocks": 3}]
    staged = make_config(model={"architecture": {"time": depth}, "stacking": {"stages": stages}})
    assert fixed_step_of(staged) == 21  # the last of 3 stages: (2^2 - 1) x 7
