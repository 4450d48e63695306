"""The plan's decisions reach the trainer as one frozen object (apr/steps/resolved.py): the run
builds from it and re-derives nothing."""

from __future__ import annotations

import dataclasses

import pytest

from apr import apply as apply_module
from apr.apply import run_apply
from apr.plan.build import build_plan
from apr.steps import execution as execution_policy
from apr.steps.execution import parse
from apr.steps.resolved import Resolved
from apr.train import build as engine_module
from tests.train.run_helpers import make_dataset, write_config
from tests.train.tiny import make_config


def test_execution_at_another_depth_keeps_the_policy():
    config = make_config()
    ex = parse("selective", "workspace", 4, compile=True)
    resolved = Resolved(config=config, execution=ex, world_size=1, nodes=1, total_steps=10)
    assert resolved.execution_at(4) is ex
    shallow = resolved.execution_at(2)  # a stacking stage of 2 blocks
    assert (shallow.layers, shallow.activations, shallow.gradients, shallow.compile) == (2, "selective",
                                                                                       "workspace", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.world_size = 2  # frozen: nothing downstream edits it


def test_the_plan_resolves_its_config_policy_and_layout(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000})
    plan = build_plan(cfg)
    resolved = plan.resolved
    assert resolved.config is plan.config and resolved.world_size == 1 and resolved.total_steps == 3
    assert resolved.execution.to_dict() == {k: plan.execution["policy"][k] for k in resolved.execution.to_dict()}
    assert resolved.elastic is None


def test_apply_runs_what_the_plan_resolved_without_deriving_a_policy(tmp_path, monkeypatch):
    """After the plan, asking for the config's own policy (``from_config``) fails the test: the run
    takes the plan's ``Resolved`` and builds its engine from it."""
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000})
    real_plan, planned, built = apply_module.build_plan, [], []

    def plan_then_forbid(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        planned.append(plan)

        def forbidden(config):
            raise AssertionError("the run re-derived the execution policy from the config")

        monkeypatch.setattr(execution_policy, "from_config", forbidden)
        return plan

    real_build = engine_module.build_engine

    def spy(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(apply_module, "build_plan", plan_then_forbid)
    monkeypatch.setattr(engine_module, "build_engine", spy)
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
    assert result.status == "finished" and result.final_step == 3
    (engine,) = built
    assert engine.execution == planned[0].resolved.execution
