"""The memory model under each execution policy, and the plan's choice of policy."""

from __future__ import annotations

from apr.memory.table import total_bytes
from apr.plan.memory import choose_execution
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


def _plan_memory(tmp_path, name: str, training: dict) -> dict:
    """``apr train plan --json``'s memory rows for an example config with ``training`` merged in."""
    import json

    from typer.testing import CliRunner

    from apr.cli.main import app
    from apr.plan.examples import materialize

    training = {"mixed_precision": "fp32", "max_steps": 8, **training}
    path, _ = materialize({"config": {"training": training}}, tmp_path / name)
    out = CliRunner().invoke(app, ["train", "plan", str(path), "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)["facts"]["memory"]["by_component"]


ACTIVATION_ROWS = ("activation_checkpoints", "kept_activations", "block_activations")


def test_autograd_activation_rows_follow_the_policy_as_the_walks_do(tmp_path):
    # gradient accumulation keeps the gradients through the backward on both sources, so the kept
    # graphs are not offset by gradients that replace them (plain autograd with one micro-batch)
    rows = {(engine, acts): _plan_memory(tmp_path, f"{engine}-{acts.replace(':', '')}", {
        "engine": engine, "gradient_accumulation": 2, "execution": {"activations": acts, "gradients": "kept"}})
        for engine in ("standard", "interleaved") for acts in ("keep", "keep_first:1", "selective", "recompute")}

    def activations(key) -> int:
        return sum(rows[key].get(c, 0) for c in ACTIVATION_ROWS)

    standard = {acts: activations(("standard", acts)) for acts in ("keep", "keep_first:1", "selective", "recompute")}
    assert standard["recompute"] < standard["selective"] < standard["keep"]
    assert standard["recompute"] < standard["keep_first:1"] < standard["keep"]
    # each block's kept graph is the walk's: per block, the same bytes on both sources (fp32: no
    # autocast weight copies, which only autograd keeps)
    for acts in ("keep", "keep_first:1", "selective"):
        assert rows[("standard", acts)]["kept_activations"] == rows[("interleaved", acts)]["kept_activations"] > 0
    assert rows[("standard", "keep")]["kept_activations"] == 2 * rows[("standard", "keep_first:1")]["kept_activations"]
    assert rows[("standard", "recompute")]["kept_activations"] == 0
    # recompute keeps each recomputed block's input and the last block's output: the walk's 2 + 1 block
    # inputs, without its residual gradient (2 more slices of the same size)
    walk = rows[("interleaved", "recompute")]["activation_checkpoints"]
    assert rows[("standard", "recompute")]["activation_checkpoints"] == walk // 5 * 3
    assert "activation_checkpoints" not in rows[("standard", "keep")]
