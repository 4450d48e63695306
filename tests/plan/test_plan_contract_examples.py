"""Every contract's examples, materialised as real config + Parquet shards + tokenizer and planned.

A passing example must leave its contract passed (not skipped); a failing one must fail it with the
contract's severity and a message containing the example's ``message_contains``. No example may
trip an evaluation error or render an unavailable template part in any contract.
"""

from __future__ import annotations

import pytest
from plan_helpers import plan_for, result

from apr.plan.contracts import load_contracts

CONTRACTS = load_contracts().contracts
CASES = [pytest.param(c, i, ex, id=f"{c.id}-{i}-{ex['expect']}") for c in CONTRACTS for i, ex in enumerate(c.examples)]


def test_every_contract_has_a_passing_and_a_failing_example():
    for c in CONTRACTS:
        assert {ex["expect"] for ex in c.examples} == {"pass", "fail"}, f"{c.id} needs a passing and a failing example"
        assert any(ex.get("message_contains") for ex in c.examples if ex["expect"] == "fail"), \
            f"{c.id}: a failing example must name what its message shows (message_contains)"


def test_contract_ids_titles_and_families_are_well_formed():
    ids = [c.id for c in CONTRACTS]
    assert len(ids) == len(set(ids))
    families = {c.family for c in CONTRACTS}
    assert {"training-config-v1", "architecture-v1", "memory-v1", "data-v1", "tokenizer-v1"} <= families
    for c in CONTRACTS:
        assert c.rationale and c.title and c.path, c.id
        assert c.severity in ("error", "warning", "info")


@pytest.mark.parametrize(("contract", "index", "example"), CASES)
def test_contract_example(contract, index, example, tmp_path):
    plan = plan_for(example, tmp_path)
    r = result(plan, contract.id)
    if example["expect"] == "pass":
        assert r.status == "passed", f"{contract.id} example {index}: {r.status} {r.reason} {r.finding}"
    else:
        assert r.status == "failed" and r.finding is not None, f"{contract.id} example {index}: {r.status} {r.reason}"
        assert r.finding.severity == contract.severity and r.finding.code == contract.id
        for text in example.get("message_contains", []):
            assert text in r.finding.message, f"{text!r} not in {r.finding.message!r}"
        # located at the contract's key in the config file
        assert r.finding.file == str(plan.config_path) and r.finding.line is not None
        assert r.finding.path == contract.path
    broken = [x.contract.id for x in plan.results if x.reason == "evaluation error"]
    assert not broken, f"contracts failed to evaluate: {broken}"
    for f in plan.findings:
        text = " ".join(filter(None, (f.message, f.expected, f.got)))
        assert "unavailable>" not in text, f"{f.code}: {text}"


def test_base_example_passes_every_error_and_warning_contract(example_dir):
    from apr.plan.build import build_plan

    plan = build_plan(example_dir)
    assert plan.errors == [] and plan.warnings == [], plan.findings
    assert {f.code for f in plan.infos} <= {c.id for c in CONTRACTS if c.severity == "info"}
    assert not [r for r in plan.results if r.reason == "evaluation error"]
