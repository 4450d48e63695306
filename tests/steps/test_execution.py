"""Execution policies: parsing, cost in forward-equivalents, what auto means without a budget."""

from __future__ import annotations

import pytest

from apr.steps.execution import describe, from_config, parse, step_cost_f
from tests.train.tiny import make_config


@pytest.mark.parametrize(("activations", "gradients", "clip", "cost"), [
    ("keep", "kept", "global", 3.0),  # a plain loop's 3F
    ("recompute", "workspace", "per_block", 4.0),  # today's lean walk
    ("recompute", "workspace", "global", 7.0),  # plus a norm-only pre-pass walk
    ("keep", "workspace", "global", 5.0),  # the pre-pass walk reuses the kept graphs
    ("recompute", "kept", "global", 4.0),  # kept gradients know the global norm after one walk
    ("keep_first:1", "workspace", "per_block", 3.0 + 2 / 3),
])
def test_cost_in_forward_equivalents(activations, gradients, clip, cost):
    config = make_config(training={"clip_mode": clip})
    assert step_cost_f(config, parse(activations, gradients, 3)) == pytest.approx(cost)


def test_auto_without_a_budget_is_the_fastest_and_says_so():
    config = make_config()
    ex = from_config(config)
    assert (ex.activations, ex.gradients) == ("keep", "kept")
    assert describe(config, ex) == "3F: nothing recomputed, gradients kept"
    lean = parse("keep_first:1", "workspace", 3)
    assert describe(make_config(training={"clip_mode": "per_block"}), lean) == \
        "3.67F: 2 of 3 blocks recomputed, one gradient workspace"


def test_keep_first_is_capped_at_the_block_count():
    assert parse("keep_first:9", "kept", 3).activations == "keep"
    assert parse("keep_first:0", "kept", 3).activations == "recompute"


@pytest.mark.parametrize("engine", ["interleaved", "standard"])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("gradients", ["kept", "workspace"])
@pytest.mark.parametrize("clip,precision", [("global", "fp32"), ("per_block", "fp32"), ("per_block", "fp16"),
                                            (None, "bf16")])
def test_the_cost_and_the_step_strategy_agree_on_the_pre_pass(engine, accum, gradients, clip, precision):
    """One definition: the walk the cost counts is the walk the engine's strategy runs (a stated
    workspace under accumulation still keeps every gradient, so no pre-pass is charged)."""
    from apr.steps.strategy import step_strategy

    config = make_config(training={"engine": engine, "gradient_accumulation": accum, "mixed_precision": precision,
                                   "clip_mode": clip or "global", "grad_clip": 0.3 if clip else None})
    ex = parse("recompute", gradients, 3)
    st = step_strategy(config, ex)
    # every block recomputed: one forward more on either source; autograd never walks a pre-pass
    expected = 4.0 if engine == "standard" else 4.0 + (3.0 if st.norm_prepass else 0.0)
    assert step_cost_f(config, ex) == pytest.approx(expected)
    assert st.keeps_all_grads == (engine == "standard" or accum > 1 or gradients == "kept")


def _auto(**training):
    return make_config(training={"execution": {"compile": "auto"}, **training})


def test_compile_auto_compiles_a_run_long_enough_to_repay_it_and_not_a_short_one():
    from apr.steps.execution import COMPILE_COST_S, COMPILE_MARGIN, COMPILE_SAVES, decide_compile

    config = _auto()
    # the break-even length: steps x step time x saving = margin x the cold compile time
    break_even = COMPILE_MARGIN * COMPILE_COST_S["cpu"]["cold"] / (3.0 * COMPILE_SAVES["cpu"])
    long = decide_compile(config, device="cpu", total_steps=int(break_even * 1.1), step_seconds=3.0)
    short = decide_compile(config, device="cpu", total_steps=int(break_even * 0.9), step_seconds=3.0)
    assert long.compile and not short.compile
    assert ">=" in long.reason and "<" in short.reason and "cold cache" in long.reason
    # a warm cache (a resume, a second run) makes the short run worth compiling
    assert decide_compile(config, device="cpu", total_steps=int(break_even * 0.9), step_seconds=3.0,
                          cache_warm=True).compile


def test_compile_auto_stays_eager_and_says_why_when_it_cannot_know_or_cannot_compile():
    from apr.steps.execution import decide_compile

    config = _auto()
    unknown = decide_compile(config, device="cpu", total_steps=10_000, step_seconds=None)
    assert not unknown.compile and "--probe" in unknown.reason
    broken = decide_compile(config, device="cpu", total_steps=10_000, step_seconds=3.0, problem="no C++ compiler")
    assert not broken.compile and broken.reason == "no C++ compiler"
    assert not decide_compile(config, device="cpu", total_steps=None, step_seconds=3.0).compile
    assert not decide_compile(config, device="mps", total_steps=10_000, step_seconds=3.0).compile


def test_compile_auto_keeps_a_mixture_of_experts_eager_however_long_the_run():
    from apr.steps.execution import decide_compile

    dense = _auto()
    moe = make_config(model={"architecture": {"moe": {"num_experts": 4, "top_k": 2}}},
                      training={"execution": {"compile": "auto"}, "engine": "standard"})
    assert decide_compile(dense, device="cuda", total_steps=10**6, step_seconds=1.0).compile
    decision = decide_compile(moe, device="cuda", total_steps=10**6, step_seconds=1.0)
    assert not decision.compile and "mixture of experts" in decision.reason


def test_compile_auto_uses_a_measured_saving_over_the_assumed_one():
    from apr.steps.execution import decide_compile

    config = _auto()
    none_saved = decide_compile(config, device="cpu", total_steps=100_000, step_seconds=3.0, measured_saving=-0.02)
    assert not none_saved.compile and none_saved.saving_source == "measured by probes of both"
    assert decide_compile(config, device="cpu", total_steps=1_000, step_seconds=3.0, measured_saving=0.5).compile


def test_a_stated_compile_setting_is_kept_and_auto_runs_eager_without_a_plan():
    from apr.steps.execution import decide_compile

    assert decide_compile(make_config(training={"execution": {"compile": True}}), device="cpu", total_steps=1,
                          step_seconds=None).compile
    assert not decide_compile(make_config(training={"execution": {"compile": False}}), device="cpu",
                              total_steps=10**6, step_seconds=3.0).compile
    assert from_config(_auto()).compile is False


@pytest.mark.parametrize(("activations", "extra"), [("keep", 0.0), ("keep_first:1", 2 / 3), ("recompute", 1.0)])
def test_autograd_is_charged_the_recompute_its_policy_runs(activations, extra):
    """Autograd honours the activation policy (torch.utils.checkpoint per block), so the plan's FLOPs
    and time charge the blocks it runs twice, and the policy line says which."""
    config = make_config(training={"engine": "standard"})
    ex = parse(activations, "kept", 3)
    assert step_cost_f(config, ex) == pytest.approx(3.0 + extra)
    line = describe(config, ex)
    assert line.startswith("standard engine") is False and "standard engine (full autograd backward" in line
    assert ("blocks recomputed" in line) == (extra > 0)
