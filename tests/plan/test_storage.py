"""Issue 16 item 6: the plan's storage figures (checkpoint size, count, peak disk, free space) match
what the trainer writes, and a disk too small for the kept checkpoints fails the plan."""

from __future__ import annotations

import itertools
import json
import os
from collections import namedtuple

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan import storage
from apr.plan.build import build_plan, resolve_config
from apr.plan.examples import materialize
from apr.plan.render import render_text
from apr.train.cadence import Cadence

Usage = namedtuple("Usage", "total used free")


def _codes(plan, severity="error"):
    return {f.code for f in plan.findings if f.severity == severity}


@pytest.mark.parametrize("total, save, evaluate, validates", [
    *itertools.product((1, 7, 24, 100), (1, 3, 10, 1000), (0, 4, 5), (True, False))])
def test_checkpoint_count_matches_the_run_loops_cadence(total, save, evaluate, validates):
    cadence = Cadence(total_steps=total, log_interval=1, eval_interval=evaluate, save_interval=save,
                      validates=validates)
    scheduled = sum(cadence.save(s, False, False) for s in range(1, total + 1))
    every_best = sum(cadence.save(s, cadence.validate(s), False) for s in range(1, total + 1))
    got = storage.checkpoints_written(total, save, evaluate, validates)
    assert got["scheduled"] == scheduled and got["max"] == every_best


@pytest.mark.slow  # a real (tiny, CPU) run: mostly the cost of importing torch
def test_sizes_match_a_real_runs_checkpoint_files(tmp_path, monkeypatch):
    from apr.train.run import ApplyOptions, prepare_run

    monkeypatch.chdir(tmp_path)  # output_dir "run/" is relative to the current folder, as in apply
    cfg_path, kw = materialize({"config": {"training": {"keep_last": 10, "max_steps": 20, "save_interval": 5,
                                                        "eval_interval": 10}}}, tmp_path / "a")
    plan = build_plan(cfg_path, **kw)
    st = plan.facts["storage"]
    run = prepare_run(resolve_config(plan.config), config_hash=config_hash(plan.config), config_path=cfg_path,
                      options=ApplyOptions(echo=lambda line: None))
    assert run.execute().exit_code == 0
    run_dir = tmp_path / "run"
    assert st["output_dir"] == str(run_dir)
    weights = sorted(run_dir.glob("checkpoint-step-*.safetensors"))
    assert len(weights) == st["written"]["scheduled"] == 4  # steps 5, 10, 15, 20; keep_last 10 keeps them all
    assert {p.stat().st_size for p in weights} == {st["weights_bytes"]}  # exact, header included
    for sidecar in run_dir.glob("checkpoint-*.json"):
        assert sidecar.stat().st_size <= st["sidecar_bytes"]
    assert st["best"] and (run_dir / "checkpoint-best.safetensors").stat().st_size == st["weights_bytes"]
    assert st["kept_checkpoints"] == 5 and st["peak_checkpoints"] == 5  # 4 + best: keep_last never bites


def test_the_peak_counts_the_new_checkpoint_written_before_the_oldest_is_pruned(tmp_path):
    cfg_path, kw = materialize({"config": {"training": {"keep_last": 2}}}, tmp_path / "a")
    st = build_plan(cfg_path, **kw).facts["storage"]
    assert st["written"]["max"] == 2 and st["peak_checkpoints"] == 2 + 1  # both steps + best
    cfg_path, kw = materialize({"config": {"training": {"keep_last": 1, "save_interval": 5}}}, tmp_path / "b")
    st = build_plan(cfg_path, **kw).facts["storage"]
    assert st["written"]["max"] == 4 and st["peak_checkpoints"] == 1 + 1 + 1 and st["kept_checkpoints"] == 2
    assert st["peak_bytes"] == 3 * st["checkpoint_bytes"]


def test_a_disk_too_small_for_the_kept_checkpoints_fails_the_plan(tmp_path, monkeypatch):
    cfg_path, kw = materialize({"config": {"training": {"output_dir": "runs/not/yet/made"}}}, tmp_path / "a")
    monkeypatch.chdir(tmp_path / "a")  # output_dir is relative to the current folder, as in apply
    probed = []

    def tiny_disk(path):
        probed.append(path)
        return Usage(10**9, 10**9 - 100_000, 100_000)

    monkeypatch.setattr(storage.shutil, "disk_usage", tiny_disk)
    plan = build_plan(cfg_path, **kw)
    st = plan.facts["storage"]
    assert probed == [tmp_path / "a"] and not (tmp_path / "a" / "runs").exists()  # nearest existing parent, no writes
    assert "C-DISK-001" in _codes(plan) and plan.exit_code() == 1
    finding = next(f for f in plan.findings if f.code == "C-DISK-001")
    assert finding.path == "training.keep_last" and finding.line is not None
    assert finding.got == f"{st['peak_bytes'] / 2**20:.2f} MiB needed"
    assert finding.expected == f"at most 97.66 KiB free in {tmp_path / 'a'}"
    assert "DOES NOT FIT" in render_text(plan)
    r = CliRunner().invoke(app, ["train", "plan", str(cfg_path), "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["storage"]["free_bytes"] == 100_000 and doc["storage"]["peak_bytes"] > 100_000
    assert any(f["code"] == "C-DISK-001" for f in doc["findings"])


def test_a_disk_with_room_passes(tmp_path, monkeypatch):
    cfg_path, kw = materialize({}, tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: Usage(10**12, 0, 10**12))
    plan = build_plan(cfg_path, **kw)
    assert "C-DISK-001" not in _codes(plan) and plan.facts["storage"]["free_bytes"] == 10**12
    assert plan.facts["storage"]["free_path"] == str(tmp_path)


def test_a_resumed_runs_checkpoints_count_as_space_it_has(tmp_path, monkeypatch):
    cfg_path, kw = materialize({}, tmp_path / "a")
    monkeypatch.chdir(tmp_path / "a")
    run = tmp_path / "a" / "run"
    run.mkdir()
    (run / "checkpoint-step-10.safetensors").write_bytes(b"x" * 300_000)
    os.link(run / "checkpoint-step-10.safetensors", run / "checkpoint-best.safetensors")  # counted once
    (run / "checkpoint-step-10.json").write_bytes(b"{}" * 500)
    (run / "notes.txt").write_bytes(b"y" * 10_000)  # not a checkpoint
    peak = build_plan(cfg_path, **kw).facts["storage"]["peak_bytes"]
    free = peak - 300_000  # short of the peak by less than the existing checkpoints hold
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))
    plan = build_plan(cfg_path, **kw)
    st = plan.facts["storage"]
    assert st["existing_bytes"] == 301_000 and st["available_bytes"] == free + 301_000
    assert "C-DISK-001" not in _codes(plan)
    (run / "checkpoint-step-10.safetensors").unlink()
    (run / "checkpoint-best.safetensors").unlink()
    plan = build_plan(cfg_path, **kw)
    assert "C-DISK-001" in _codes(plan)  # without them the same disk is too small


def test_background_saves_block_only_when_a_write_outlasts_the_steps_to_the_next_save():
    facts = {"seconds_per_checkpoint": 10.0, "background": False}
    assert storage.blocking_seconds(facts, 20, 4.0) == 200.0  # synchronous: every write
    facts["background"] = True
    assert storage.blocking_seconds(facts, 20, 4.0) == 20 * 6.0  # one in flight: the next save waits 6 s
    assert storage.blocking_seconds(facts, 20, 30.0) == 0.0  # hidden behind the steps


def test_a_sharded_run_writes_its_parts_synchronously_in_parallel():
    """Under sharding each rank writes 1/K of a checkpoint before the next step (no background
    writer): the plan says so and times one part, not the whole file, per save."""
    doc = {"model": {"architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}},
           "data": {"train": "x/", "batch_size": 2, "seq_len": 32}, "optimizer": {"lr": 1e-3},
           "training": {"max_steps": 100, "save_interval": 10, "output_dir": "o/", "sharding": "full"}}
    config = AprConfig.model_validate(doc)
    one = storage.storage_facts(config, 100, 50.0, world_size=1)  # one process: sharding does not apply
    eight = storage.storage_facts(config, 100, 50.0, world_size=8)
    assert one["background"] and one["parts"] == 1
    assert not eight["background"] and eight["parts"] == 8
    assert eight["checkpoint_bytes"] == one["checkpoint_bytes"]  # the same bytes on disk, in 8 files
    assert eight["seconds_per_checkpoint"] == one["seconds_per_checkpoint"] / 8
    assert eight["blocking_seconds"] == eight["written"]["max"] * eight["seconds_per_checkpoint"]


def test_the_row_losses_blame_records_are_every_row_of_every_logged_step():
    doc = {"model": {"architecture": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64}},
           "data": {"train": "x/", "batch_size": 2, "seq_len": 32}, "optimizer": {"lr": 1e-3},
           "training": {"max_steps": 105, "log_interval": 10, "gradient_accumulation": 3, "output_dir": "o/"}}
    config = AprConfig.model_validate(doc)
    rl = storage.storage_facts(config, 105, None, world_size=4)["row_losses"]
    assert (rl["rows_per_logged_step"], rl["logged_steps"]) == (2 * 3 * 4, 11)  # steps 10..100 and 105
    assert rl["bytes"] == 24 * 11 * storage.ROW_LOSS_BYTES
    assert storage.row_loss_facts(config, 100)["logged_steps"] == 10
