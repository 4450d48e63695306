"""The reference's incidents, end to end: ALB-060 fails with C-TRAINCFG-001, the v2 config passes.

The configs are the shipped 350M v2 config with the data paths pointed at real Parquet shards of
the reference's row counts. Rows are 65 tokens (seq_len 64) instead of 1025 to keep the shards
small: the step algebra depends on row counts only.
"""

from __future__ import annotations

import pytest
from plan_helpers import result

from apr.config.loader import read_yaml
from apr.plan.build import build_plan
from apr.plan.examples import deep_merge, to_yaml, write_shards, write_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def v2_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2")
    write_shards(root / "v1-train", rows=22_079, row_len=SEQ + 1, max_token=32_767, shards=3)
    write_shards(root / "v2-train", rows=67_977, row_len=SEQ + 1, max_token=32_767, shards=4)
    write_shards(root / "val", rows=500, row_len=SEQ + 1, max_token=32_767, shards=1, seed=99)
    write_tokenizer(root / "tokenizer.json", 32_768)
    return root


def _config(repo, root, train: str, training: dict):
    raw, _, _ = read_yaml(repo / "configs/train/pretrain-350m-v2.yaml")
    doc = deep_merge(raw, {"data": {"train": str(root / train), "val": str(root / "val"), "seq_len": SEQ,
                                    "tokenizer": str(root / "tokenizer.json")},
                           "training": training})
    path = root / f"{train}-{len(training)}.yaml"
    path.write_text(to_yaml(doc))
    return path


def test_alb060_fails_with_steps_per_epoch_43(repo, v2_inputs):
    cfg = _config(repo, v2_inputs, "v1-train", {"epochs": 1, "max_steps": 5000, "warmup_steps": 2000,
                                                 "gradient_accumulation": 128})
    plan = build_plan(cfg)
    r = result(plan, "C-TRAINCFG-001")
    assert r.status == "failed" and r.finding.severity == "error"
    msg = r.finding.message
    assert "steps_per_epoch = 43" in msg and "only 43 of 5,000 steps will run" in msg
    assert "22,079 sequences" in msg and "gradient_accumulation 128" in msg
    assert "epochs >= 117" in msg  # the reference's own fix for the v1 data: epochs 117
    assert plan.facts["steps"]["steps_per_epoch"] == 43 and plan.facts["steps"]["total_steps"] == 43
    # the warmup never ends, and the plan reports the LR the reference saw (6.45e-6 of 3e-4)
    warm = result(plan, "C-TRAINCFG-003")
    assert warm.status == "failed" and "6.45e-06" in warm.finding.message
    assert plan.exit_code() == 1
    # the finding points at training.max_steps in the config file
    assert r.finding.file == str(cfg) and r.finding.line is not None
    assert cfg.read_text().splitlines()[r.finding.line - 1].strip().startswith("max_steps:")


def test_v2_config_with_67977_sequences_and_38_epochs_passes(repo, v2_inputs):
    cfg = _config(repo, v2_inputs, "v2-train", {"epochs": 38})
    plan = build_plan(cfg, gpu="4090")
    # the one warning: its save_interval 25 writes 200 checkpoints of ~5 GiB (issue 16 item 6, C-DISK-002)
    assert plan.errors == [] and [f.code for f in plan.warnings] == ["C-DISK-002"], [f.code for f in plan.findings]
    steps = plan.facts["steps"]
    assert steps["num_sequences"] == 67_977 and steps["steps_per_epoch"] == 16_994
    assert steps["total_steps"] == 5000 and result(plan, "C-TRAINCFG-001").status == "passed"
    assert plan.exit_code() == 0
    assert result(plan, "C-MEM-001").status == "passed"  # the reference trained this on a 24 GB 4090


def test_plan_steps_agree_with_the_trainers_loader(tmp_path):
    """The plan's step algebra is the loader's: the same shard listing, the same floor."""
    from apr.data.loader import ShardLoader
    from apr.plan.examples import materialize

    for rows, batch, accum in ((64, 2, 1), (101, 4, 3), (50, 7, 2)):
        folder = tmp_path / f"r{rows}-{batch}-{accum}"
        cfg, _ = materialize({"train": {"rows": rows, "shards": 3},
                              "config": {"data": {"batch_size": batch},
                                         "training": {"gradient_accumulation": accum}}}, folder)
        plan = build_plan(cfg)
        loader = ShardLoader(folder / "train", seq_len=32, batch_size=batch, gradient_accumulation=accum)
        assert plan.facts["steps"]["steps_per_epoch"] == loader.steps_per_epoch
        assert plan.facts["data"]["train"]["sequences"] == loader.num_rows == rows


def test_nested_shards_are_counted_like_the_loader(tmp_path):
    from apr.plan.examples import materialize

    cfg, _ = materialize({}, tmp_path)
    write_shards(tmp_path / "train" / "part2", rows=10, row_len=33, max_token=100)
    plan = build_plan(cfg)
    assert plan.facts["data"]["train"]["shards"] == 3 and plan.facts["data"]["train"]["sequences"] == 74


def test_largest_micro_batch_is_the_boundary(tmp_path):
    from apr.memory.table import total_bytes, with_batch_size
    from apr.plan.examples import materialize
    from apr.steps.execution import parse

    cfg, _ = materialize({}, tmp_path)
    plan = build_plan(cfg, vram="700MiB")
    best = plan.facts["memory"]["max_micro_batch"]
    assert best > 1
    # the boundary under the leanest policy (full recompute, one gradient workspace)
    lean = parse("recompute", "workspace", plan.config.model.architecture.num_hidden_layers)
    assert total_bytes(with_batch_size(plan.config, best), execution=lean) <= 700 * 2**20
    assert total_bytes(with_batch_size(plan.config, best + 1), execution=lean) > 700 * 2**20
