"""The memory model under each execution policy, and the plan's choice of policy."""

from __future__ import annotations

from apr.plan.memory import choose_execution, total_bytes
from apr.steps.execution import parse
from tests.train.tiny import make_config


def _config(**training):
    return make_config(data={"batch_size": 8}, training=training)


def test_a_roomy_budget_gets_the_fastest_policy_and_a_tight_one_the_fastest_that_fits():
    config = _config()
    roomy = choose_execution(config, 2**40, "--vram")
    assert (roomy.execution.activations, roomy.execution.gradients, roomy.cost_f) == ("keep", "kept", 3.0)
    lean = parse("recompute", "workspace", 3)
    tight = total_bytes(config, execution=parse("recompute", "kept", 3))
    choice = choose_execution(config, tight, "--vram")
    assert choice.fits and choice.total_bytes <= tight
    assert choice.cost_f < roomy.cost_f + 1.01  # kept gradients: no pre-pass walk
    assert choice.execution.gradients == "kept"
    nothing = choose_execution(config, 1, "--vram")  # nothing fits: the leanest (the memory contract fails)
    assert not nothing.fits and nothing.execution == lean


def test_memory_grows_with_what_is_kept():
    config = _config()
    sizes = {a: total_bytes(config, execution=parse(a, "workspace", 3))
             for a in ("recompute", "selective", "keep_first:1", "keep_first:2", "keep")}
    assert sizes["recompute"] < sizes["selective"] < sizes["keep"]
    assert sizes["recompute"] < sizes["keep_first:1"] < sizes["keep_first:2"] < sizes["keep"]
    assert total_bytes(config, execution=parse("keep", "workspace", 3)) < total_bytes(
        config, execution=parse("keep", "kept", 3))


def test_a_stated_policy_is_kept_and_reports_the_fastest_that_fits():
    config = _config(execution={"activations": "keep", "gradients": "kept"})
    budget = total_bytes(config, execution=parse("recompute", "kept", 3))
    choice = choose_execution(config, budget, "--vram")
    assert choice.execution == parse("keep", "kept", 3) and not choice.fits
    facts = choice.facts(config)
    assert facts["policy_fits"] is False
    assert facts["fastest_fitting"]["total_bytes"] <= budget


def test_accumulation_leaves_only_kept_gradients():
    config = _config(gradient_accumulation=2)
    alts = choose_execution(config).alternatives
    assert {a["gradients"] for a in alts} == {"kept"}


def test_the_standard_engine_plans_with_a_budget():
    # every activations choice costs the standard engine the same: ties must not break the choice
    config = _config(engine="standard")
    choice = choose_execution(config, 2**40, "--vram")
    assert choice.fits and choice.cost_f == 3.0 and choice.execution.gradients == "kept"
