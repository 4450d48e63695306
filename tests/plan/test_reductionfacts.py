"""training.reduction: canonical (apr/plan/reductionfacts.py): refused at its key, with the layouts that work,
where a part of the run sums in an order of its own; where it holds, validate and the plan say its cost."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import load_config
from apr.model.spec import trainable_param_count
from apr.plan.reductionfacts import reduction_cost, reduction_findings

runner = CliRunner()

BASE = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 2\n    intermediate_size: 128\n    vocab_size: 256\n"
        "    max_position_embeddings: 64\n"
        "data:\n  train: t/\n  val: v/\n  batch_size: 2\n  seq_len: 32\n"
        "training:\n  max_steps: 1000\n  eval_interval: 100\n  reduction: canonical\n")


@pytest.mark.parametrize(("extra", "named"), [
    ("  engine: interleaved\n  execution: {gradients: workspace}\n", "training.execution.gradients: workspace"),
    ("  engine: interleaved\n  sharding: full\n  world_size: 2\n  execution: {gradients: workspace}\n",
     "training.execution.gradients: workspace"),
    ("  engine: standard\n  mode: distill\n  distill: {teacher: t/, cache_teacher_outputs: true}\n",
     "training.distill.cache_teacher_outputs"),
    ("  engine: interleaved\n", "dropout"),
    ("  engine: standard\n  sharding: full\n  world_size: 2\n", "optimizer.name: swats"),
])
def test_canonical_where_it_cannot_hold_is_refused_at_its_key_with_the_layouts_that_work(tmp_path, extra, named):
    cfg = tmp_path / "c.yaml"
    # dropout's masks and SWATS's sums over the shards depend on the rank (found by review: not bitwise)
    more = {"dropout": "    dropout: 0.1\n", "optimizer.name: swats": ""}.get(named, "")
    text = BASE.replace("    max_position_embeddings: 64\n", "    max_position_embeddings: 64\n" + more) + extra
    if named == "optimizer.name: swats":
        text += "optimizer:\n  name: swats\n"
    cfg.write_text(text)
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert r.exit_code == 1 and "Traceback" not in r.stdout
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.reduction"]
    line = 18 + (named == "dropout")  # the dropout line comes before training
    assert len(found) == 1 and found[0]["path"] == "training.reduction" and found[0]["line"] == line
    assert named in found[0]["message"] and named in found[0]["got"]
    assert "training.engine: standard" in found[0]["expected"] and "interleaved" in found[0]["expected"]
    assert "full, hybrid" in found[0]["expected"]  # the FSDP2 layouts that work are named


def test_canonical_on_autograd_says_what_it_costs(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  engine: standard\n  gradient_accumulation: 2\n  world_size: 4\n")
    found = reduction_findings(load_config(cfg))
    assert [(f.severity, f.path) for f in found] == [("info", "training.reduction")]
    assert "8 micro-batch gradients summed in one fixed tree" in found[0].message
    # the world sizes that keep the global batch of 8 micro-batches: every one sums the same tree
    assert "bitwise the same on 1, 2, 4 or 8 rank(s)" in found[0].message
    assert reduction_cost(load_config(cfg).config, 2**20, 4)["invariant_world_sizes"] == [1, 2, 4, 8]
    assert reduction_findings(load_config(cfg), world_size=1)[0].message.startswith("canonical reduction: 2 ")


@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_canonical_on_fsdp2_is_accepted_and_says_what_its_all_to_all_costs(tmp_path, sharding):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + f"  engine: standard\n  sharding: {sharding}\n  gradient_accumulation: 2\n"
                   "  world_size: 4\n  nodes: 2\n")
    loaded = load_config(cfg)
    found = reduction_findings(loaded)
    assert [(f.severity, f.path) for f in found] == [("info", "training.reduction")]
    assert "2 all-to-all(s) and an all-gather sending" in found[0].message
    cost = reduction_cost(loaded.config, 2**20, 4)
    # at the last all-to-all: the last local gradient and every global micro-batch's rows of this shard
    # (2 micro-batches x the replicas: hybrid over 2 nodes sends each shard's rows to both), and under
    # hybrid the copy being sent to the replicas
    assert cost["extra_bytes"] == {"full": 1 + 2, "hybrid": 1 + 2 * 2 + 2}[sharding] * 2**20


@pytest.mark.parametrize("extra", [
    "  orchestrator: {enabled: true, candidates: [conservative_adamw, aggressive_adamw]}\n",
    "  mode: distill\n  distill: {teacher: t/}\n",
], ids=["orchestrator", "distill"])
def test_canonical_holds_for_the_orchestrator_and_distillation_and_says_its_cost(tmp_path, extra):
    """Their decisions read the tree's step loss and the canonical validation loss (world-size free)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  engine: standard\n  sharding: full\n  world_size: 2\n" + extra)
    found = reduction_findings(load_config(cfg))
    assert [(f.severity, f.path) for f in found] == [("info", "training.reduction")]
    assert "bitwise the same on 1 or 2 rank(s)" in found[0].message  # 2 global micro-batches


@pytest.mark.parametrize("sharding", ["none", "full"])
def test_canonical_on_the_walk_keeps_its_gradients_and_the_plan_counts_the_leaves_against_the_budget(tmp_path,
                                                                                                  sharding):
    """The flat-buffer walk under canonical: validate accepts it, its gradients are kept for the step
    (the tree needs every micro-batch's whole gradient before the first update), and the plan's memory
    table holds the leaves as a row of their own, in its total."""
    from apr.memory.table import memory_table
    from apr.steps.execution import keeps_all_grads, parse
    from apr.steps.strategy import step_strategy

    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + f"  engine: interleaved\n  sharding: {sharding}\n  world_size: 2\n")
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert r.exit_code == 0, r.stdout
    config = load_config(cfg).config
    assert step_strategy(config).keeps_all_grads and not step_strategy(config).norm_prepass
    fast = config.model_copy(update={"training": config.training.model_copy(update={"reduction": "fast"})})
    workspace = parse("keep", "workspace", 2)  # what the plan may pick for fast when the kept gradients do not fit
    assert not keeps_all_grads(fast, workspace) and keeps_all_grads(config, workspace)  # canonical never streams
    rows = {r.component: r.bytes for r in memory_table(config)}
    grads = 4 * trainable_param_count(config)  # one float32 gradient of the model
    peak = reduction_cost(config, grads, 2)["extra_bytes"]
    # replicated: this rank's slices of both micro-batches (one gradient), the mean gathered and joined (2)
    # and its half; on shards: the last local leaf and its shard's rows of both
    assert peak == {"none": 3 * grads + grads // 2, "full": 2 * grads}[sharding]
    assert 0 < rows["canonical_leaves"] <= peak  # what the sum adds beyond the freed activations
    assert "gradients" in rows and "canonical_leaves" not in {r.component for r in memory_table(fast)}


def test_the_plan_counts_canonicals_leaves_in_its_memory_total(tmp_path):
    """`apr train plan` on the walk under canonical: the leaves are a row of the memory table and in the
    total its budget check reads (the policy choice and the fit read the same table); the same run under
    fast has no such row."""
    from apr.plan.build import build_plan
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path)
    plans = {reduction: build_plan(write_config(tmp_path, f"{reduction}.yaml", training={
        "engine": "interleaved", "reduction": reduction, "world_size": 2, "gradient_accumulation": 2}))
        for reduction in ("fast", "canonical")}
    rows = {k: {r.component: r.bytes for r in p.memory} for k, p in plans.items()}
    assert "canonical_leaves" not in rows["fast"]
    grads = 4 * trainable_param_count(load_config(tmp_path / "canonical.yaml").config)
    # the walk keeps its buffers: the earlier micro-batch's leaf beside the last backward at least
    assert grads <= rows["canonical"]["canonical_leaves"] <= reduction_cost(
        load_config(tmp_path / "canonical.yaml").config, grads, 2)["extra_bytes"]
    others = {k: {c: b for c, b in r.items() if c not in ("canonical_leaves", "allocator_slack")}
              for k, r in rows.items()}
    assert others["canonical"] == others["fast"]  # everything else the same: the leaves are the difference
    totals = {k: p.facts["memory"]["total_bytes"] for k, p in plans.items()}
    slack = rows["canonical"]["allocator_slack"] - rows["fast"]["allocator_slack"]  # slack grows with the leaves
    assert slack > 0 and totals["canonical"] - totals["fast"] == rows["canonical"]["canonical_leaves"] + slack


def test_the_time_per_step_is_modelled_from_the_copies_and_the_bytes_sent_beyond_fast(tmp_path):
    """The plan's time per step for canonical: its copies at the copy rate and what it sends beyond fast's
    all-reduce at the link rate, both per device; stated as measured on the CPU and assumed on GPUs."""
    from apr.plan.reductionfacts import COPY_BYTES_PER_S, LINK_BYTES_PER_S

    cfg = tmp_path / "c.yaml"
    cfg.write_text(BASE + "  engine: standard\n  gradient_accumulation: 2\n  device: cpu\n")
    config = load_config(cfg).config
    grad = 2**20
    one, two = reduction_cost(config, grad, 1), reduction_cost(config, grad, 2)
    assert one["extra_seconds_per_step"] == pytest.approx(4 * grad / COPY_BYTES_PER_S["cpu"])  # written, read
    # 2 ranks: 8 gradients copied; sends 1.5 gradients (2 halves to the other rank, half the mean back)
    # where fast's ring all-reduce sends one
    assert two["extra_seconds_per_step"] == pytest.approx(8 * grad / COPY_BYTES_PER_S["cpu"]
                                                          + 0.5 * grad / LINK_BYTES_PER_S["cpu"])
    assert "a step, modelled" in two["line"] and "measured on a 2-core CPU" in two["line"]
    gpu = config.model_copy(update={"training": config.training.model_copy(update={"device": "cuda"})})
    on_gpu = reduction_cost(gpu, grad, 2)
    assert on_gpu["extra_seconds_per_step"] < two["extra_seconds_per_step"] and "assumed" in on_gpu["line"]
