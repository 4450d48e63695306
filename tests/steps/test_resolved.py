"""The plan's decisions reach the trainer as one frozen object (apr/steps/resolved.py): the run
builds from it and re-derives nothing."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from apr import apply as apply_module
from apr.apply import run_apply
from apr.plan.build import build_plan
from apr.steps import execution as execution_policy
from apr.steps.execution import parse
from apr.steps.resolved import resolve
from apr.train import build as engine_module
from tests.train.run_helpers import make_dataset, write_config
from tests.train.tiny import make_config


def test_execution_at_another_depth_keeps_the_policy():
    config = make_config(model={"architecture": {"num_hidden_layers": 4}})
    ex = parse("selective", "workspace", 4, compile=True)
    resolved = resolve(config, execution=ex)
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
    # the step algebra and schedule the trainer runs are the plan's own figures
    steps = plan.facts["steps"]
    assert (resolved.steps.num_sequences, resolved.steps.epoch_steps, resolved.steps.tokens_per_step) == (
        steps["num_sequences"], steps["epoch_steps"], steps["tokens_per_step"])
    assert resolved.schedule.total_steps == 3 and resolved.schedule.peak == plan.config.optimizer.lr
    assert resolved.gradient_source == "interleaved" and resolved.strategy.engine == "interleaved"


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


def test_resolve_lays_the_config_out_for_the_world_size_and_an_elastic_resume():
    config = make_config(training={"gradient_accumulation": 4})
    four = resolve(config, world_size=4, num_sequences=400)
    assert four.config.training.world_size == 4 and four.config is not config
    assert four.steps.sequences_per_step == config.data.batch_size * 4 * 4
    elastic = {"from_world_size": 1, "to_world_size": 2, "from_accumulation": 4, "to_accumulation": 2,
               "message": "resume: 1 -> 2 ranks"}
    two = resolve(config, world_size=2, num_sequences=400, elastic=elastic)
    assert two.config.training.gradient_accumulation == 2 and two.elastic == elastic
    one = resolve(config, num_sequences=400)
    assert two.steps.sequences_per_step == one.steps.sequences_per_step  # the global batch is kept
    assert two.steps.total_steps == one.steps.total_steps
    assert resolve(config, world_size=1).steps is None  # an engine-only resolution reads no data


FORBIDDEN_AFTER_PLAN = [  # (module, name): what the trainer used to re-derive from the config
    ("apr.steps.execution", "from_config"), ("apr.steps.execution", "gradient_source"),
    ("apr.steps.strategy", "step_strategy"), ("apr.steps.resolved", "step_strategy"),
    ("apr.steps.algebra", "step_count"), ("apr.steps.resolved", "laid_out"),
    ("apr.steps.schedule.LRSchedule", "from_config"),
]


def test_apply_derives_nothing_after_the_plan(tmp_path, monkeypatch):
    """Once the plan is made, every function that turns a config into steps, a schedule, a layout,
    a gradient source or a step strategy fails the test: the run is a function of its Resolved."""
    import importlib

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000,
                                           "gradient_accumulation": 2})
    real_plan = apply_module.build_plan

    def plan_then_forbid(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        plan.resolved  # noqa: B018  (resolved before the trap is set, as apply does)
        frozen = plan.resolved
        monkeypatch.setattr(type(plan), "resolved", property(lambda self: frozen))
        for module, name in FORBIDDEN_AFTER_PLAN:
            path, _, attr = module.rpartition(".") if module.endswith("LRSchedule") else (module, "", "")
            owner = getattr(importlib.import_module(path), attr) if attr else importlib.import_module(module)

            def forbidden(*a, _name=f"{module}.{name}", _real=getattr(owner, name), **k):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("apr.train"):  # the trainer; the shared buffer plan may compute
                    raise AssertionError(f"{caller} re-derived {_name} after the plan")
                return _real(*a, **k)

            monkeypatch.setattr(owner, name, forbidden)
        return plan

    monkeypatch.setattr(apply_module, "build_plan", plan_then_forbid)
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lambda line: None)
    assert (result.status, result.final_step, result.total_steps) == ("finished", 3, 3)


def test_a_run_refuses_data_that_changed_after_the_plan(tmp_path):
    from apr.errors import AprError
    from apr.plan.build import resolve_config
    from apr.train.run import ApplyOptions, prepare_run

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000})
    plan = build_plan(cfg)
    stale = dataclasses.replace(plan.resolved, steps=dataclasses.replace(
        plan.resolved.steps, num_sequences=plan.resolved.steps.num_sequences + 1))
    with pytest.raises(AprError, match="the data changed after the plan was made"):
        prepare_run(stale, config_hash=plan.config_hash, config_path=cfg,
                    options=ApplyOptions(apr_home=tmp_path / "home", handle_signals=False))
    # the same config resolved without a saved plan counts the same rows the plan counted
    assert resolve_config(plan.config).steps == plan.resolved.steps


def test_a_plan_for_other_ranks_is_refused_by_the_process_that_runs_it(tmp_path):
    from apr.errors import AprError
    from apr.train.layout import device_and_ranks

    with pytest.raises(AprError, match="the plan was made for 4 rank"):
        device_and_ranks(resolve(make_config(), world_size=4))


def test_the_trainer_source_derives_nothing_from_a_config():
    """The issue's numbers, kept: no call under apr/train that turns a config into a plan decision,
    and no module but run.py moves the loop's step or swaps its engine."""
    import re
    from pathlib import Path

    root = Path(apply_module.__file__).parent / "train"
    calls = re.compile(r"(?<![\w])(from_config|step_count|laid_out|gradient_source|step_strategy)\(")
    moves = re.compile(r"\brun\.(step|engine)\s*=[^=]")
    found, moved = [], []
    for path in sorted(root.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if calls.search(code):
                found.append(f"{path.name}:{n}: {line.strip()}")
            if path.name != "run.py" and moves.search(code):
                moved.append(f"{path.name}:{n}: {line.strip()}")
    assert found == [] and moved == []
