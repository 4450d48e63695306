"""training.orchestrator and optimizer.name checks (apr/plan/orchestratefacts.py): validate names the
key path (and line) of each bad input; the plan shows the branches' overhead."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import load_config
from apr.plan.orchestratefacts import orchestrator_facts, orchestrator_findings

runner = CliRunner()

BASE = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    intermediate_size: 128\n    vocab_size: 256\n"
        "    max_position_embeddings: 64\n"
        "data:\n  train: t/\n  val: v/\n  batch_size: 2\n  seq_len: 32\n"
        "training:\n  max_steps: 1000\n  eval_interval: 100\n")


def _findings(tmp_path, orchestrator: str, extra: str = "") -> list[dict]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  orchestrator:\n" + orchestrator + extra)
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert r.exit_code == 1 and "Traceback" not in r.stdout  # an error, rendered: no traceback
    return [f for f in json.loads(r.stdout)["findings"] if f["code"] in ("config.orchestrator", "config.optimizer")]


def test_unknown_strategy_names_are_errors_at_their_key_path_and_line(tmp_path):
    found = _findings(tmp_path, "    enabled: true\n    initial_strategy: conservativ_adamw\n"
                      "    candidates: [sgd_escape, turbo]\n")
    by_path = {f["path"]: f for f in found}
    assert by_path["training.orchestrator.initial_strategy"]["line"] == 20
    assert "conservativ_adamw" in by_path["training.orchestrator.initial_strategy"]["got"]
    assert by_path["training.orchestrator.candidates[1]"]["got"] == "'turbo'"
    assert "sgd_escape" in by_path["training.orchestrator.candidates[1]"]["expected"]


def test_a_horizon_longer_than_the_decision_interval_is_an_error(tmp_path):
    found = _findings(tmp_path, "    enabled: true\n    decision_interval: 50\n    eval_horizon: 80\n")
    assert [f["path"] for f in found] == ["training.orchestrator.eval_horizon"]
    assert found[0]["expected"] == "<= 50" and found[0]["got"] == "80"


def test_settings_the_orchestrator_cannot_honour_are_refused(tmp_path):
    found = _findings(tmp_path, "    enabled: true\n    strategies:\n      mine: {clip_mode: adagc}\n",
                      "  engine: standard\n")
    paths = {f["path"] for f in found}
    # "mine" needs AdaGC's EMAs; sgd_escape (a built-in candidate) runs on autograd too
    assert paths == {"training.orchestrator.strategies.mine.clip_mode"}


def test_sgd_and_swats_run_on_autograd_and_on_shards(tmp_path):
    """optimizer.name sgd / swats: every gradient source calls the updater's update_group, on shards
    too (apr/train/updaters.py); only adafactor is refused there, at the key with the reason."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  engine: standard\noptimizer:\n  name: swats\n")
    assert orchestrator_findings(load_config(cfg), 1000) == []
    cfg.write_text(BASE + "  sharding: full\noptimizer:\n  name: swats\n")
    assert orchestrator_findings(load_config(cfg), 1000) == []
    cfg.write_text(BASE + "  sharding: full\n  engine: standard\noptimizer:\n  name: adafactor\n")
    found = orchestrator_findings(load_config(cfg), 1000)
    assert [(f.path, f.line) for f in found] == [("optimizer.name", 21)]
    assert "training.sharding: full" in found[0].message


def test_orchestration_and_its_sgd_strategies_run_on_shards(tmp_path):
    """A switch of updater carries the moments on every source (apr/train/autograd.py Params.adopt):
    the built-in sgd_escape candidate is no longer refused off the unsharded walk."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  sharding: full\n  orchestrator:\n    enabled: true\n"
                   "    candidates: [conservative_adamw, spike_resistant]\n")
    assert orchestrator_findings(load_config(cfg), 1000) == []
    for extra in ("  sharding: full\n", "  engine: standard\n"):  # sgd_escape, a built-in candidate
        cfg.write_text(BASE + "  orchestrator:\n    enabled: true\n" + extra)
        r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
        assert r.exit_code == 0, r.stdout


def test_orchestration_without_validation_data_is_an_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE.replace("  val: v/\n", "") + "  orchestrator: {enabled: true}\n")
    found = orchestrator_findings(load_config(cfg), 1000)
    assert [f.path for f in found] == ["training.orchestrator.enabled"] and "validation" in found[0].message


def test_the_plan_facts_count_k_minus_one_horizons_per_decision_and_two_state_copies(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  orchestrator: {enabled: true, decision_interval: 300, eval_horizon: 50, branches: 3}\n")
    memory = {"by_component": {"weights": 100, "adamw_m": 100, "adamw_v": 100, "activations": 999}}
    facts = orchestrator_facts(load_config(cfg).config, 1000, memory)
    assert facts["decisions"] == 3 and facts["branches"] == 3  # after steps 300, 600, 900
    assert facts["extra_steps"] == 3 * 50 * 2 and facts["extra_fraction"] == 0.3
    assert facts["extra_bytes"] == 2 * 300 and "sgd_escape" in facts["sgd_strategies"]


def test_a_decision_near_the_end_has_its_horizon_clipped_to_the_run(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  orchestrator: {enabled: true, decision_interval: 400, eval_horizon: 300, branches: 2}\n")
    facts = orchestrator_facts(load_config(cfg).config, 1000, None)
    assert facts["extra_steps"] == 300 + 199  # after step 800: 199 steps, the last one is the loop's


def test_the_plan_text_shows_the_overhead_memory_and_time_of_the_branches(tmp_path):
    from apr.plan.render import orchestrator_lines

    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  orchestrator: {enabled: true, decision_interval: 300, eval_horizon: 50, branches: 3}\n")
    facts = orchestrator_facts(load_config(cfg).config, 1000, {"by_component": {"weights": 2**20, "adamw_m": 2**20,
                                                                                "adamw_v": 2**20}})
    facts["extra_seconds"] = 90.0
    text = "\n".join(orchestrator_lines(facts))
    assert "3 decision points; 3 branches x horizon 50 steps" in text
    assert "300 extra optimizer steps (30.0% of the run" in text and "6.00 MiB: 2 state copies" in text
    assert "time estimate includes the branches: +" in text


def test_state_copies_that_do_not_fit_the_memory_budget_are_an_error_at_branches(tmp_path):
    from apr.plan.orchestratefacts import orchestrator_memory_findings, orchestrator_memory_rows

    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  orchestrator: {enabled: true, decision_interval: 300, eval_horizon: 50, branches: 4}\n")
    loaded = load_config(cfg)
    gib = 2**30
    memory = {"by_component": {"weights": gib, "adamw_m": gib, "adamw_v": gib}, "total_bytes": 5 * gib,
              "vram_bytes": 10 * gib}
    facts = orchestrator_facts(loaded.config, 1000, memory)
    rows = orchestrator_memory_rows(facts, memory)
    assert [(r.component, r.bytes) for r in rows] == [("branch_states", 6 * gib)]  # 2 copies, whatever K
    memory["total_bytes"] += rows[0].bytes  # as the plan adds its rows
    found = orchestrator_memory_findings(loaded, facts, memory)
    assert [(f.path, f.line) for f in found] == [("training.orchestrator.branches", 18)]
    assert "6.00 GiB" in found[0].message and found[0].got == "11.00 GiB"


def test_adafactor_keys_at_their_defaults_are_not_refused_for_another_optimizer(tmp_path):
    """A run's saved config.yaml states every key, the adafactor ones at their defaults: a fork or a
    re-plan of it must not be refused for them (only a changed value would be ignored silently)."""
    from apr.config.schema import OptimizerConfig

    defaults = {k: f.default for k, f in OptimizerConfig.model_fields.items() if k.startswith("adafactor_")}
    assert defaults
    cfg = tmp_path / "c.yaml"
    stated = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in defaults.items())
    cfg.write_text(BASE + "optimizer:\n  name: adamw\n" + stated)
    assert orchestrator_findings(load_config(cfg), 1000) == []
    cfg.write_text(BASE + "optimizer:\n  name: adamw\n  adafactor_clip_threshold: 2.0\n")
    assert [f.path for f in orchestrator_findings(load_config(cfg), 1000)] == ["optimizer.adafactor_clip_threshold"]
