"""apr/plan/statefacts.py: what validate refuses about bf16 state, at training.state_dtype; and the
plan's words and bytes for it (apr/memory/buffers.py, apr/plan/configfacts.py, apr/plan/render.py)."""

from __future__ import annotations

from apr.config.loader import load_config
from apr.plan.examples import to_yaml
from apr.plan.statefacts import state_dtype_findings
from tests.train.tiny import make_config


def test_validate_refuses_bf16_state_where_it_is_not_built(tmp_path):
    def findings(optimizer=None, **training):
        doc = make_config().model_dump(mode="json")
        doc["training"].update({"mixed_precision": "bf16", "state_dtype": "bf16", **training})
        doc["optimizer"].update(optimizer or {})
        path = tmp_path / "cfg.yaml"
        path.write_text(to_yaml(doc))
        return state_dtype_findings(load_config(path))

    assert findings() == []
    cases = [({"mixed_precision": "fp16"}, "mixed_precision: bf16"), ({"engine": "standard"}, "engine: interleaved"),
             ({"sharding": "full", "world_size": 2}, "sharding: none"), ({"world_size": 2}, "world_size: 1"),
             ({"gradient_accumulation": 2}, "gradient_accumulation: 1")]
    for training, expected in cases:
        (f,) = findings(**training)
        assert (f.severity, f.path, f.expected) == ("error", "training.state_dtype", f"training.{expected}"), training
        assert f.line is not None and "bf16" in f.message
    (lion,) = findings({"name": "lion"})
    assert lion.expected == "optimizer.name: adamw" and "lion" in lion.got


def test_the_plan_counts_bf16_state_at_6_bytes_a_parameter_and_says_how_it_rounds():
    from apr.memory.table import memory_table
    from apr.model.spec import param_count
    from apr.plan.configfacts import execution_facts
    from apr.plan.render import _execution_lines

    fp32 = make_config(training={"mixed_precision": "bf16"})
    bf16 = make_config(training={"mixed_precision": "bf16", "state_dtype": "bf16"})
    params = param_count(bf16.model.architecture)
    full, half = ({r.component: r for r in memory_table(c)} for c in (fp32, bf16))
    assert [sum(rows[k].bytes for k in ("weights", "adamw_m", "adamw_v")) for rows in (full, half)] == [
        12 * params, 6 * params]
    assert "compute_weights" in full and "compute_weights" not in half  # the bf16 weights are computed with
    assert half["gradients"].bytes * 2 == full["gradients"].bytes
    assert "stochastic rounding" in half["adamw_m"].detail and "bf16" in half["weights"].detail
    facts = execution_facts(bf16)
    assert (facts["state_dtype"], facts["state_bytes_per_param"]) == ("bf16", 6)
    assert execution_facts(fp32)["state_bytes_per_param"] == 12

    class Plan:
        execution = {**facts, "compile": None, "policy": None}

    lines = [line for line in _execution_lines(Plan) if line.startswith("state ")]
    assert lines == ["state bf16: weights and AdamW moments 6 B/param (fp32: 12), each update computed in fp32 and "
                     "stored with stochastic rounding"]
