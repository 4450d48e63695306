"""The composed engine: build_engine picks the gradient source and loss the config and plan say, and
hands the plan's execution policy through unchanged."""

from __future__ import annotations

import pytest

from apr.steps.execution import gradient_source, parse
from apr.steps.resolved import resolve as plan_of
from apr.train.autograd import Autograd
from apr.train.build import build_engine
from apr.train.engine import Engine
from apr.train.losses import CausalLM
from apr.train.walk import Walk
from tests.train.tiny import make_config


@pytest.mark.parametrize(("engine", "cls"), [("interleaved", Walk), ("standard", Autograd)])
def test_the_configured_gradient_source_is_built_with_the_causal_lm_loss(engine, cls):
    built = build_engine(plan_of(make_config(training={"engine": engine})))
    assert type(built) is Engine and type(built.gradients) is cls
    assert isinstance(built.loss, CausalLM) and built.kind == engine
    assert not built.sharded


def test_the_plans_execution_policy_is_the_engines_own_object():
    config = make_config(training={"execution": {"activations": "keep", "gradients": "workspace"}})
    chosen = parse("recompute", "workspace", 3, False)  # what a plan under a tight budget would choose
    assert build_engine(plan_of(config, execution=chosen)).execution is chosen


def test_distillation_runs_on_autograd_whatever_training_engine_says():
    config = make_config(training={"mode": "distill", "engine": "interleaved", "distill": {"teacher": "unused"}})
    assert gradient_source(config) == "standard"
    assert gradient_source(make_config(training={"engine": "interleaved"})) == "interleaved"
