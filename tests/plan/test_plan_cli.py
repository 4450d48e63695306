"""`apr train plan` through the CLI: exit codes, text and JSON output, -out, usage errors."""

from __future__ import annotations

import json
import os

import torch
from plan_helpers import apr_cli
from typer.testing import CliRunner

from apr.checkpoint.manager import CheckpointManager, TrainState
from apr.cli.main import app
from apr.config import load_config
from apr.config.schema import AprConfig
from apr.model.spec import param_specs
from apr.plan.examples import materialize
from apr.plan.planfile import load_plan_file

runner = CliRunner()


def plan(*args):
    return runner.invoke(app, ["train", "plan", *map(str, args)])


def test_clean_run_exits_zero_with_terraform_like_text(example_dir):
    r = plan(example_dir, "--gpu", "4090")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for heading in ("Resolved run", "Resources per GPU (target: NVIDIA GeForce RTX 4090 24GB", "Time (estimate)"):
        assert heading in out
    assert "164,160 parameters" in out and "steps_per_epoch 32 x epochs 1 = 32; max_steps 20 -> 20 steps" in out
    assert "kernels auto -> torch" in out  # device: cpu
    last = out.strip().splitlines()[-1]
    assert last.startswith("Plan: ") and last.endswith(" passed, 0 warnings, 0 errors.")


def test_errors_exit_one_and_name_contract_file_line(tmp_path):
    cfg, _ = materialize({"config": {"training": {"gradient_accumulation": 4}}}, tmp_path)
    r = plan(cfg)
    assert r.exit_code == 1
    line = next(ln for ln in r.stdout.splitlines() if "error[C-TRAINCFG-001]" in ln)
    assert f"{cfg}:" in line and "training.max_steps" in line
    assert "steps_per_epoch = 8" in r.stdout and "expected: epochs x steps_per_epoch >= max_steps = 20" in r.stdout
    assert r.stdout.strip().splitlines()[-1].endswith(" 1 errors.")


def test_warnings_fail_only_with_strict(tmp_path):
    cfg, _ = materialize({"config": {"training": {"warmup_steps": 8}}}, tmp_path)  # warmup 40%
    r = plan(cfg)
    assert r.exit_code == 0 and "warning[C-TRAINCFG-004]" in r.stdout
    assert plan(cfg, "--strict").exit_code == 1
    info_only, _ = materialize({}, tmp_path / "info")  # info findings never fail, even with --strict
    assert plan(info_only, "--strict").exit_code == 0


def test_json_is_one_documented_object(example_dir):
    from apr.plan.build import PLAN_KEYS

    r = plan(example_dir, "--json", "--gpu", "h100", "--world-size", "2")
    assert r.exit_code == 1, r.output  # 64 rows / (2 x 2) = 16 steps < max_steps 20
    doc = json.loads(r.stdout)
    assert tuple(doc) == PLAN_KEYS
    assert doc["format"] == "apr-plan" and doc["world_size"] == 2
    assert doc["facts"]["steps"]["steps_per_epoch"] == 16  # 64 rows / (2 x 1 x 2)
    assert doc["memory"]["rows"][0]["component"] == "weights" and doc["memory"]["vram_bytes"] > 0
    assert doc["time_estimate"]["gpus"] == 2 and doc["time_estimate"]["estimated_seconds"] > 0
    assert doc["summary"]["errors"] == 1 and doc["summary"]["passed"] > 30
    assert doc["findings"][0]["code"] == "C-TRAINCFG-001" and doc["findings"][0]["severity"] == "error"
    assert {c["status"] for c in doc["contracts"]} <= {"passed", "failed", "skipped"}
    assert all({"severity", "code", "message", "path", "file", "line"} <= set(f) for f in doc["findings"])
    assert len(doc["config_hash"]) == 64 and len(doc["data_fingerprint"]["files"]) == 4
    assert doc["run"]["execution"]["kernels_resolved"] == "torch"


def test_json_with_errors_still_parses_and_exits_one(tmp_path):
    cfg, _ = materialize({"train": {"missing": True}}, tmp_path)
    r = plan(cfg, "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert [f["code"] for f in doc["findings"] if f["severity"] == "error"] == ["C-DATA-001"]


def test_config_errors_exit_one_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  architecture:\n    hidden_size: wide\n")
    r = apr_cli("train", "plan", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{bad}:3:" in r.stderr and "model.architecture.hidden_size" in r.stderr
    missing = apr_cli("train", "plan", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "config file not found" in missing.stderr and "Traceback" not in missing.stderr
    j = runner.invoke(app, ["train", "plan", str(bad), "--json"])
    assert j.exit_code == 1
    found = {f["path"]: f for f in json.loads(j.stdout)["findings"]}
    assert found["model.architecture.hidden_size"]["line"] == 3 and "data" in found  # data: missing


def test_usage_errors_exit_two(example_dir):
    assert plan().exit_code == 2
    assert plan(example_dir, "--bogus").exit_code == 2
    r = plan(example_dir, "--gpu", "tpu-v9")
    assert r.exit_code == 2 and "unknown GPU 'tpu-v9'" in r.output and "h100" in r.output
    assert plan(example_dir, "--vram", "lots").exit_code == 2
    r = plan(example_dir, "--vram", "24")  # once read as 24 bytes ("2813885733.3% of 24 B")
    assert r.exit_code == 2 and "24GiB" in r.output and "%" not in r.output
    assert plan(example_dir, "--world-size", "0").exit_code == 2


def test_vram_and_world_size_options(example_dir):
    r = plan(example_dir, "--vram", "2MiB")  # the base run (device: cpu, no CUDA context) needs >= 2.9 MiB
    assert r.exit_code == 1 and "error[C-MEM-001]" in r.stdout and "DOES NOT FIT" in r.stdout
    r = plan(example_dir, "--world-size", "4")  # 64 rows / 8 per step = 8 < max_steps 20
    assert r.exit_code == 1 and "world_size 4" in r.stdout


def test_out_saves_a_plan_file_single_or_double_dash(example_dir, tmp_path):

    for flag in ("-out", "--out"):
        target = tmp_path / f"plan{flag}.json"
        r = plan(example_dir, flag, target)
        assert r.exit_code == 0, r.output
        doc = load_plan_file(target)
        assert doc["config_path"] == str(example_dir.resolve()) and doc["summary"]["errors"] == 0
        assert f"apr train apply {target}" in r.stdout


def test_out_is_not_written_when_the_plan_fails(tmp_path):
    cfg, _ = materialize({"train": {"missing": True}}, tmp_path)
    target = tmp_path / "plan.json"
    r = plan(cfg, "-out", target)
    assert r.exit_code == 1 and not target.exists() and "plan not saved" in r.output


def test_plan_never_imports_torch_and_writes_nothing(example_dir):
    before = sorted(p.relative_to(example_dir.parent) for p in example_dir.parent.rglob("*"))
    r = apr_cli("train", "plan", str(example_dir), "--gpu", "4090", probe=True)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("Plan: ")
    assert sorted(p.relative_to(example_dir.parent) for p in example_dir.parent.rglob("*")) == before


def test_out_refuses_devices_inputs_and_existing_files(tmp_path, example_dir):
    """-out never replaces a device node, the config it plans, or a file without --overwrite."""
    before = os.stat("/dev/null")
    r = plan(example_dir, "-out", "/dev/null")
    assert r.exit_code == 1 and "is a device" in r.output and "Traceback" not in r.output
    assert os.stat("/dev/null").st_ino == before.st_ino
    config_text = example_dir.read_text()
    r = plan(example_dir, "-out", example_dir, "--overwrite")
    assert r.exit_code == 1 and "is an input of this command" in r.output
    assert example_dir.read_text() == config_text
    target = tmp_path / "plan.json"
    target.write_text("mine")
    r = plan(example_dir, "-out", target)
    assert r.exit_code == 1 and "--overwrite" in r.output and target.read_text() == "mine"
    r = plan(example_dir, "-out", target, "--overwrite")
    assert r.exit_code == 0, r.output
    assert load_plan_file(target)["summary"]["errors"] == 0


def test_apply_refuses_hostile_inputs_before_importing_torch(tmp_path):
    """A bad config or plan file given to apply fails in the time validate takes (no torch import)."""
    import os

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    bomb = tmp_path / "cfg.yaml"
    bomb.write_text("a: &a [1,2,3,4,5,6,7,8,9]\n" + "".join(
        f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)))
    for target, code in ((fifo, "file.not_regular"), (bomb, "yaml.too_large")):
        r = apr_cli("train", "apply", str(target), probe=True, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        assert "HEAVY []" in r.stderr and code in r.stdout + r.stderr and "Traceback" not in r.stderr


def test_a_run_that_fits_only_sharded_is_told_which_strategy_and_what_each_gives(tmp_path):
    """~0.8B parameters (16 bytes each unsharded: 12 GiB) against 8 GiB per rank on 8 ranks: the
    plan lists each strategy's per-rank total and largest micro-batch, and warns naming the first
    strategy that fits."""
    arch = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 5504}
    cfg, _ = materialize({"config": {"model": {"architecture": arch}, "data": {"batch_size": 2},
                                     "training": {"max_steps": 4, "warmup_steps": 0}}}, tmp_path)
    r = plan(cfg, "--json", "--vram", "8GiB", "--world-size", "8")
    doc = json.loads(r.stdout)
    sh = doc["facts"]["sharding"]
    per_rank = sh["per_rank_bytes"]
    assert sh["world_size"] == 8 and sh["strategy"] == "none"
    assert per_rank["none"] > 8 * 2**30 >= per_rank["shard_grad_op"] > per_rank["full"]
    assert doc["memory"]["total_bytes"] == per_rank["none"]  # the configured strategy is the memory table
    assert sh["fits"] == {"none": False, "shard_grad_op": True, "full": True}
    assert sh["max_micro_batch"]["none"] == 0 < sh["max_micro_batch"]["shard_grad_op"] <= sh["max_micro_batch"]["full"]
    deepest = {k: v["num_hidden_layers"] for k, v in sh["largest_model"].items()}
    assert deepest["none"] < 16 <= deepest["shard_grad_op"] <= deepest["full"]  # 16 blocks fit only sharded
    assert sh["largest_model"]["full"]["params"] > doc["facts"]["model"]["params"]
    warning = next(f for f in doc["findings"] if f["code"] == "plan.sharding")
    assert warning["severity"] == "warning" and warning["path"] == "training.sharding"
    assert "would with training.sharding: shard_grad_op" in warning["message"]
    text = plan(cfg, "--vram", "8GiB", "--world-size", "8").stdout
    assert "per rank at 8 ranks by training.sharding (configured: none):" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("full "))
    assert "fits, largest micro-batch" in line and "blocks (" in line
    # configured full sharding: the memory table is one rank's at --world-size ranks, and fits
    cfg, _ = materialize({"config": {"model": {"architecture": arch}, "data": {"batch_size": 2},
                                     "training": {"max_steps": 4, "warmup_steps": 0, "sharding": "full"}}},
                         tmp_path / "full")
    doc = json.loads(plan(cfg, "--json", "--vram", "8GiB", "--world-size", "8").stdout)
    assert doc["memory"]["total_bytes"] == per_rank["full"] <= doc["memory"]["vram_bytes"]
    assert not any(f["code"] == "plan.sharding" for f in doc["findings"])


def test_hybrid_sharding_is_planned_at_the_nodes_given_and_refuses_uneven_nodes(tmp_path):
    """--world-size 16 --nodes 2 under hybrid: each node's 8 ranks share a shard, so a rank holds
    what full sharding over 8 ranks gives it; 6 ranks on 4 nodes fail the plan naming both keys; a
    config that leaves world_size to torchrun is not refused for its nodes."""
    arch = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "intermediate_size": 5504}
    cfg, _ = materialize({"config": {"model": {"architecture": arch}, "data": {"batch_size": 2},
                                     "training": {"max_steps": 1, "warmup_steps": 0, "sharding": "hybrid",
                                                  "nodes": 2}}}, tmp_path)
    r = plan(cfg, "--json", "--vram", "8GiB", "--world-size", "16")
    assert r.exit_code == 0, r.stdout
    doc = json.loads(r.stdout)
    sh = doc["facts"]["sharding"]
    assert doc["nodes"] == sh["nodes"] == 2 and sh["world_size"] == 16
    full_on_8 = json.loads(plan(cfg, "--json", "--vram", "8GiB", "--world-size", "8", "--nodes", "1",
                                "training.sharding=full").stdout)["facts"]["sharding"]["per_rank_bytes"]["full"]
    assert doc["memory"]["total_bytes"] == sh["per_rank_bytes"]["hybrid"] == full_on_8
    assert sh["per_rank_bytes"]["full"] < sh["per_rank_bytes"]["hybrid"]  # full shards over all 16
    text = plan(cfg, "--vram", "8GiB", "--world-size", "16").stdout
    assert "per rank at 16 ranks on 2 nodes by training.sharding (configured: hybrid):" in text
    # on 4 nodes of 4, a shard group is 4 ranks: more per rank than on 2 nodes of 8
    four = json.loads(plan(cfg, "--json", "--vram", "8GiB", "--world-size", "16", "--nodes", "4").stdout)
    assert four["nodes"] == 4 and four["memory"]["total_bytes"] > doc["memory"]["total_bytes"]
    r = plan(cfg, "--json", "--world-size", "6", "--nodes", "4")
    assert r.exit_code == 1
    f = next(f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.sharding")
    assert f["path"] == "training.nodes" and "--world-size" in f["message"] and "--nodes" in f["message"]
    assert (f["expected"], f["got"]) == ("nodes dividing 6", "4")
    r = plan(cfg, "--json", "--vram", "8GiB", "--world-size", "2", "--nodes", "4")  # more nodes than ranks
    assert r.exit_code == 1 and any(f["code"] == "config.sharding" for f in json.loads(r.stdout)["findings"])
    assert plan(cfg, "--json").exit_code == 0  # one process: nothing to split yet


def test_a_resume_on_a_world_size_that_cannot_keep_the_global_batch_fails_the_plan(tmp_path, monkeypatch):
    """training.output_dir holds a checkpoint saved by 2 ranks x accumulation 2 (4 micro-batches a
    step): planned on 3 ranks the plan fails naming both keys and the sizes that work; on 4 ranks
    it says which accumulation a --resume will use."""
    cfg, _ = materialize({"config": {"training": {"max_steps": 4, "warmup_steps": 0}}}, tmp_path)
    monkeypatch.chdir(tmp_path)  # training.output_dir run/ is relative to the working directory
    r = plan(cfg, "--json", "--world-size", "3")
    assert not any(f["code"] == "plan.resume_world_size" for f in json.loads(r.stdout)["findings"])  # no checkpoint
    config = load_config(cfg).config
    saved = config.model_dump(mode="json")
    saved["training"].update(world_size=2, gradient_accumulation=2)
    tensors = {p.name: torch.zeros(p.shape) for p in param_specs(config.model.architecture)}
    tensors.update({f"optimizer.{k}.{n}": torch.zeros_like(t) for n, t in list(tensors.items()) for k in "mv"})
    CheckpointManager(tmp_path / "run", AprConfig.model_validate(saved)).save(TrainState(2, tensors, {"epoch": 0}))
    r = plan(cfg, "--json", "--world-size", "3")
    assert r.exit_code == 1
    f = next(f for f in json.loads(r.stdout)["findings"] if f["code"] == "plan.resume_world_size")
    assert f["severity"] == "error" and f["path"] == "training.world_size" and f["file"] == str(cfg)
    assert "training.gradient_accumulation 2" in f["message"] and "resume on 1, 2, 4 ranks" in f["message"]
    r = plan(cfg, "--json", "--world-size", "4")
    f = next(f for f in json.loads(r.stdout)["findings"] if f["code"] == "plan.resume_world_size")
    assert f["severity"] == "info" and "uses training.gradient_accumulation 1" in f["message"]
