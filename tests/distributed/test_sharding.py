"""Sharded data parallelism (training.sharding, torch FSDP2 on the CPU with gloo) and resuming on
another number of ranks: 2 sharded ranks equal 1 process with twice the batch; a run stopped on
N ranks and resumed on M ends at the uninterrupted run's weights and reads exactly its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apr.checkpoint.manager import read_checkpoint
from apr.config.schema import AprConfig
from apr.memory.buffers import buffer_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.ranks import run_ranks, run_script  # noqa: E402

WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"
OPT = {"lr": 3e-3, "min_lr": 3e-4}


def _launch(doc: dict, path: Path, nproc: int, resume: str | None = None, rows: Path | None = None,
            ok: bool = True, shards: Path | None = None, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120", "APR_HOME": str(path.parent / "home")}
    if rows is not None:
        env["APR_TEST_ROWS_LOG"] = str(rows)
    if shards is not None:
        env["APR_TEST_SHARDS"] = str(shards)
    env.update(extra_env or {})
    if nproc > 1:  # the ranks as torchrun describes them, without its process (tests/distributed/ranks.py)
        proc = run_ranks(args, nproc, env, timeout=240)
    else:
        proc = run_script(args, env, timeout=240)
    if ok:  # each rank's error first: torchrun's own summary fills the end of stderr
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln and "torch/distributed" not in ln]
        assert proc.returncode == 0, "\n".join(errors[-20:]) + "\n" + proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The checkpoint's whole tensors (a sharded run's come in one part per rank)."""
    return read_checkpoint(run_dir / f"checkpoint-step-{step}.json").tensors


def _rel(a: dict, b: dict) -> float:
    """The largest relative difference (Frobenius norms) over the weights and the AdamW moments."""
    assert set(a) == set(b)
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in a)


# (engine, sharding, micro-batch per rank, accumulation, clipping, execution policy): the standard engine,
# and the interleaved engine's three step paths on shards (norm pre-pass, kept gradient shards with
# accumulation, AdamW per block in the hook). The one process reads twice the micro-batch.
CASES = [
    ("standard", "full", 2, 1, "global", None),
    ("standard", "shard_grad_op", 2, 2, None, None),  # no clipping
    ("interleaved", "full", 2, 1, "global", {"activations": "recompute", "gradients": "workspace"}),
    ("interleaved", "shard_grad_op", 2, 2, "global", {"activations": "keep"}),
    ("interleaved", "full", 2, 1, "per_block", {"activations": "selective", "gradients": "workspace"}),
]


def _planned(doc: dict) -> dict[str, int]:
    return {b.name: b.numel for b in buffer_plan(AprConfig.model_validate(
        {**doc, "training": {**doc["training"], "world_size": 2}}))}


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "sharding", "batch", "accum", "clip_mode", "execution"), CASES)
def test_two_sharded_ranks_equal_one_process_with_twice_the_batch(tmp_path, engine, sharding, batch, accum, clip_mode,
                                                                  execution):
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 10, "save_interval": 10, "eval_interval": 5, "engine": engine,
              "grad_clip": 0.5 if clip_mode else None, "clip_mode": clip_mode or "global",
              **({"execution": execution} if execution else {})}
    common["gradient_accumulation"] = accum
    one = config_doc(tmp_path, data={"batch_size": 2 * batch}, optimizer=OPT, training={**common, "output_dir": "one/"})
    two = config_doc(tmp_path, data={"batch_size": batch}, optimizer=OPT,
                     training={**common, "output_dir": "two/", "sharding": sharding})
    _launch(one, tmp_path / "one.json", 1)
    _launch(two, tmp_path / "two.json", 2, shards=tmp_path / "shards.json")
    # the same tolerance as the DDP test (tests/distributed/test_data_parallel.py): 1e-6 relative
    assert _rel(_weights(tmp_path / "two", 10), _weights(tmp_path / "one", 10)) <= 1e-6
    # the plan's per-rank buffers are the shards FSDP2 really gave rank 0
    planned = _planned(two)
    shards = json.loads((tmp_path / "shards.json").read_text())
    real = shards["groups"]
    assert real and all(planned[f"{g}.flat_params"] == r["params"] == planned[f"{g}.adam_m"] == r["adam_m"]
                        for g, r in real.items()), (real, planned)
    assert sum(r["params"] for r in real.values()) < sum(b.numel for b in buffer_plan(AprConfig.model_validate(one))
                                                         if b.component == "weights")
    if engine == "interleaved" and execution.get("gradients") == "workspace":
        # AdamW (or the norm pre-pass) per group as its shard arrives: never more than one group's
        # gradient shard at once, and the plan has no per-group gradient buffer
        assert 0 < shards["max_live_grad"] <= planned["grad_shard"] == max(r["params"] for r in real.values())
        assert not any(name.endswith(".grad") for name in planned)
    elif engine == "interleaved":  # kept gradient shards: every group's, and no more
        assert 0 < shards["max_live_grad"] <= sum(planned[f"{g}.grad"] for g in real)
    state = json.loads((tmp_path / "two" / "training_state.json").read_text())
    assert state["status"] == "finished" and state["val_loss"] is not None
    _assert_same_block_norms(tmp_path / "two", tmp_path / "one")


def _assert_same_block_norms(run: Path, ref: Path) -> None:
    """monitoring.block_norms on shards: each block's gradient and update norm, all-reduced from the
    shards', as the unsharded run records them."""
    got, want = (json.loads((d / "training_state.json").read_text())["block_norms"] for d in (run, ref))
    assert got["step"] == want["step"] > 0
    for key in ("block_grad_norm", "block_update_norm", "embed_update_norm", "head_grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "accum", "clip_mode"), [("interleaved", 1, "adagc"), ("standard", 2, "global")],
                         ids=["hybrid-interleaved-1-adagc", "hybrid-standard-2-global"])  # apr/steps/composition.py
def test_hybrid_sharding_replicates_across_nodes_and_equals_one_process(tmp_path, engine, accum, clip_mode):
    """2 ranks as 2 one-rank 'nodes' (APR_SHARD_GROUP_SIZE=1): each holds a whole replica, gradients
    all-reduced across the replicas; the same weights as one process with twice the batch. The
    interleaved walk with AdaGC (per-tensor norms from the shards') and no accumulation; the standard
    engine with accumulation 2 and global clipping."""
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 6, "save_interval": 6, "eval_interval": 3, "engine": engine,
              "grad_clip": 0.5, "clip_mode": clip_mode, "gradient_accumulation": accum}
    one = config_doc(tmp_path, data={"batch_size": 4}, optimizer=OPT, training={**common, "output_dir": "one/"})
    two = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT,
                     training={**common, "output_dir": "two/", "sharding": "hybrid", "nodes": 2})
    _launch(one, tmp_path / "one.json", 1)
    _launch(two, tmp_path / "two.json", 2, shards=tmp_path / "shards.json", extra_env={"APR_SHARD_GROUP_SIZE": "1"})
    assert _rel(_weights(tmp_path / "two", 6), _weights(tmp_path / "one", 6)) <= 1e-6
    real = json.loads((tmp_path / "shards.json").read_text())["groups"]
    planned = _planned(two)
    assert all(planned[f"{g}.flat_params"] == r["params"] for g, r in real.items())  # a whole replica per node
    _assert_same_block_norms(tmp_path / "two", tmp_path / "one")


# SGD, SWATS and Lion on FSDP2 shards: the updater's update_group over each group's local shards
# (apr/train/updaters.py), SWATS' switch test and Lion's update norm summed over the shard group.
# SWATS switches at step 3 (tolerance 1e6): the run crosses its switch on shards.
# ``none``: DDP, each rank's whole groups (the walk's one flat piece).
UPDATER_CASES = [("sgd", "standard", "full"), ("swats", "interleaved", "full"), ("lion", "standard", "hybrid"),
                 ("lion", "interleaved", "full"), ("sgd", "interleaved", "none"), ("swats", "standard", "none")]


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "engine", "sharding"), UPDATER_CASES)
def test_group_updaters_on_shards_equal_one_process_with_twice_the_batch(tmp_path, optimizer, engine, sharding):
    make_dataset(tmp_path, train_rows=160)
    opt = {**OPT, "name": optimizer, **({"swats_min_steps": 2, "swats_tolerance": 1e6} if optimizer == "swats" else {})}
    common = {"epochs": 1, "max_steps": 5, "save_interval": 5, "eval_interval": 5, "engine": engine, "grad_clip": 0.5}
    hybrid = sharding == "hybrid"
    one = config_doc(tmp_path, data={"batch_size": 4}, optimizer=opt, training={**common, "output_dir": "one/"})
    nodes = {"nodes": 2} if hybrid else {}
    two = config_doc(tmp_path, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "output_dir": "two/", "sharding": sharding, **nodes})
    _launch(one, tmp_path / "one.json", 1)
    _launch(two, tmp_path / "two.json", 2, extra_env={"APR_SHARD_GROUP_SIZE": "1"} if hybrid else None)
    assert _rel(_weights(tmp_path / "two", 5), _weights(tmp_path / "one", 5)) <= 1e-6
    if optimizer == "swats":  # every group switched to SGD at the same step on shards as on one process
        one_s, two_s = (read_checkpoint(tmp_path / d / "checkpoint-step-5.json").meta["engine"]["swats"]
                        for d in ("one", "two"))
        assert {g: s["switched_at"] for g, s in two_s.items()} == {g: 3 for g in one_s}
        assert all(two_s[g]["sgd_lr"] == pytest.approx(one_s[g]["sgd_lr"], rel=1e-5) for g in one_s)


def _rows(path: Path) -> list[int]:
    """The row read at every position of the run, in order. A log line is one global micro-batch
    (its number under the layout of the process that drew it, and its rows); position = number x
    rows per micro-batch + index, the same under any number of ranks. A position read twice (before
    a kill and again after the resume) must have been the same row both times."""
    by_position: dict[int, int] = {}
    for line in path.read_text().splitlines():
        at, rows = json.loads(line)
        for j, row in enumerate(rows):
            pos = at * len(rows) + j
            assert by_position.setdefault(pos, row) == row, f"position {pos} read differently"
    assert sorted(by_position) == list(range(len(by_position)))  # no gap
    return [by_position[p] for p in range(len(by_position))]


def _kill_rank_0_mid_save(doc: dict, path: Path, step: int, rows: Path) -> None:
    """Launch 2 ranks and SIGKILL rank 0 (the one that writes the JSON) inside step ``step``'s save:
    every part is written, the JSON is not (the worker holds rank 0 there, APR_TEST_HOLD_SAVE)."""
    import signal

    path.write_text(json.dumps(doc))
    pids = path.parent / "pids.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "60", "APR_TEST_PIDS": str(pids),
           "APR_TEST_ROWS_LOG": str(rows), "APR_HOME": str(path.parent / "home"), "APR_TEST_HOLD_SAVE": str(step)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(WORKER), str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        for line in proc.stderr:
            if line.startswith(f"holding the save of step {step}"):
                rank0 = next(int(p) for r, p in (x.split() for x in pids.read_text().splitlines()) if r == "0")
                os.kill(rank0, signal.SIGKILL)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full"])  # the layout in the id (apr/steps/composition.py)
def test_a_sharded_run_killed_mid_save_resumes_on_one_rank_as_the_uninterrupted_one(tmp_path, sharding):
    """2 ranks, full sharding; rank 0 is killed inside step 4's save, with both parts on disk and no
    JSON yet: the save never looks complete. The run resumes in one process (elastic: accumulation
    1 -> 2) from step 2's parts, ends within 1e-6 of the uninterrupted 2-rank run and reads exactly
    its rows, in order."""
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 8, "save_interval": 2, "keep_last": 5, "eval_interval": 0, "log_interval": 1,
              "engine": "standard", "sharding": sharding, "lr_scheduler": "constant", "warmup_steps": 0}
    full = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT, training={**common, "output_dir": "full/"})
    _launch(full, tmp_path / "full.json", 2, rows=tmp_path / "full-rows.jsonl")
    doc = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT, training={**common, "output_dir": "run/"})
    _kill_rank_0_mid_save(doc, tmp_path / "run.json", 4, tmp_path / "run-rows.jsonl")
    # each rank wrote its own part of step 2; step 4's parts are written but no JSON names them
    parts = {r: f"part-{r}-of-2.safetensors" for r in range(2)}
    assert {p.name for p in (tmp_path / "run").glob("checkpoint-step-2.*")} >= {
        "checkpoint-step-2.json", *(f"checkpoint-step-2.{p}" for p in parts.values())}
    assert all((tmp_path / "run" / f"checkpoint-step-4.{p}").is_file() for p in parts.values())
    assert not (tmp_path / "run" / "checkpoint-step-4.json").exists()
    proc = _launch(doc, tmp_path / "run.json", 1, "latest", rows=tmp_path / "run-rows.jsonl")
    assert "resume: 2 -> 1 ranks; gradient_accumulation 1 -> 2" in proc.stderr
    assert _rel(_weights(tmp_path / "run", 8), _weights(tmp_path / "full", 8)) <= 1e-6
    assert _rows(tmp_path / "run-rows.jsonl") == _rows(tmp_path / "full-rows.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full"])  # the layout in the id (apr/steps/composition.py)
def test_a_run_resumed_on_more_ranks_ends_as_the_uninterrupted_one(tmp_path, sharding):
    """One process (interleaved engine, accumulation 4) stopped at step 4, resumed on 2 fully sharded
    ranks (the interleaved walk on FSDP2, accumulation 2) to step 8, whose checkpoint is in 2 parts,
    then on 4 ranks as 2 nodes of 2 under hybrid sharding (a 2 x 2 mesh, accumulation 1) to step 12:
    the uninterrupted run's weights to 1e-6 at both steps, its rows in order."""
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "save_interval": 4, "keep_last": 5, "eval_interval": 0, "gradient_accumulation": 4,
              "lr_scheduler": "constant", "warmup_steps": 0, "sharding": sharding}
    full = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT,
                      training={**common, "max_steps": 12, "output_dir": "full/"})
    _launch(full, tmp_path / "full.json", 1, rows=tmp_path / "full-rows.jsonl")
    part = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT,
                      training={**common, "max_steps": 4, "output_dir": "part/"})
    _launch(part, tmp_path / "part.json", 1, rows=tmp_path / "part-rows.jsonl")
    part["training"]["max_steps"] = 8
    proc = _launch(part, tmp_path / "part.json", 2, "latest", rows=tmp_path / "part-rows.jsonl")
    assert "resume: 1 -> 2 ranks; gradient_accumulation 4 -> 2" in proc.stderr
    assert (tmp_path / "part" / "checkpoint-step-8.part-1-of-2.safetensors").is_file()
    assert _rel(_weights(tmp_path / "part", 8), _weights(tmp_path / "full", 8)) <= 1e-6
    part["training"].update(max_steps=12, sharding="hybrid", nodes=2)
    proc = _launch(part, tmp_path / "part.json", 4, "latest", rows=tmp_path / "part-rows.jsonl",
                   extra_env={"APR_SHARD_GROUP_SIZE": "2"})
    assert "resume: 2 -> 4 ranks; gradient_accumulation 2 -> 1" in proc.stderr
    assert 'resume: layout training.sharding: "full" -> "hybrid"' in proc.stderr, proc.stderr[-2000:]
    assert _rel(_weights(tmp_path / "part", 12), _weights(tmp_path / "full", 12)) <= 1e-6
    assert _rows(tmp_path / "part-rows.jsonl") == _rows(tmp_path / "full-rows.jsonl")


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_with_the_ones_that_can(tmp_path):
    from apr.errors import AprError
    from apr.plan.elastic import elastic_layout

    make_dataset(tmp_path, train_rows=160)
    doc = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT,
                     training={"max_steps": 2, "save_interval": 2, "eval_interval": 0, "gradient_accumulation": 2,
                               "output_dir": "run/"})
    _launch(doc, tmp_path / "cfg.json", 1)  # 2 micro-batches per step
    doc["training"].update(max_steps=4, world_size=3)  # as torchrun with 3 processes resolves it
    config = AprConfig.model_validate(doc)
    with pytest.raises(AprError) as err:  # apply lays the resume out before it plans
        elastic_layout(config, tmp_path / "run", "latest", 3)
    assert "which 3 ranks cannot split evenly; resume on 1, 2 ranks" in err.value.message


def test_sharding_with_what_it_cannot_run_fails_validate_naming_both_keys(tmp_path):
    """The one refusal left is a layout that cannot exist (hybrid over nodes that do not split the
    ranks); a bf16 LoRA trunk and compiled blocks validate on shards (the composition tests run them)."""
    make_dataset(tmp_path)
    env = {**os.environ, "APR_HOME": str(tmp_path / "home")}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config_doc(tmp_path, training={"sharding": "hybrid", "world_size": 4, "nodes": 3})))
    proc = subprocess.run([sys.executable, "-m", "apr", "train", "validate", str(path)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    out = proc.stdout + proc.stderr
    assert "training.sharding" in out and "training.nodes" in out
    for extra in ({"model": {"lora": {"rank": 4, "alpha": 8.0, "trunk_dtype": "bf16"}},
                   "training": {"sharding": "full", "mixed_precision": "bf16"}},
                  {"training": {"sharding": "full", "execution": {"compile": True}}}):
        path.write_text(json.dumps(config_doc(tmp_path, **extra)))
        proc = subprocess.run([sys.executable, "-m", "apr", "train", "validate", str(path), "--json"],
                              capture_output=True, text=True, timeout=60, env=env)
        refusals = [f for f in json.loads(proc.stdout)["findings"] if f["code"] == "config.sharding" and
                    f["severity"] == "error"]
        assert not refusals, proc.stdout  # (the LoRA config lacks a base, which validate reports apart)
        assert proc.returncode == 0 or "model" in extra, proc.stdout


def test_apply_plans_hybrid_at_the_nodes_torchrun_starts(monkeypatch):
    """Under torchrun, apply plans at WORLD_SIZE / LOCAL_WORLD_SIZE nodes; an uneven or unreadable
    layout counts as one node (the run itself then refuses hybrid)."""
    from apr.launch import env_nodes

    monkeypatch.delenv("APR_SHARD_GROUP_SIZE", raising=False)
    for local, world, nodes in (("8", 16, 2), ("4", 16, 4), ("16", 16, 1), ("3", 16, 1), ("x", 16, 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert env_nodes(world) == nodes, (local, world)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert env_nodes(16) == 1


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["full", "hybrid"])
def test_a_sharded_run_rolls_back_a_spike_and_ends_as_a_run_without_it(tmp_path, sharding):
    """training.rollback under sharding (the interleaved walk, 2 ranks; hybrid: two one-rank nodes,
    each a whole replica): the random-token window of steps 21-23 triggers a rollback to step 20's
    checkpoint, read in parts; the run ends bitwise where the same 2 ranks end on data that never
    held the window."""
    from tests.train.test_survive import BAD, ROLLBACK_CFG, _corpus

    ref, run = tmp_path / "ref", tmp_path / "rb"
    _corpus(ref, without_bad=True)
    _corpus(run)
    training = {"max_steps": 30, "warmup_steps": 0, "lr_scheduler": "constant", "save_interval": 5,
                "log_interval": 5, "eval_interval": 0, "grad_clip": None, "keep_last": 10, "sharding": sharding,
                **({"nodes": 2} if sharding == "hybrid" else {})}
    data = {"shuffle": False, "batch_size": 2}
    env = {"APR_SHARD_GROUP_SIZE": "1"} if sharding == "hybrid" else None
    _launch(config_doc(ref, data=data, training=training), ref / "cfg.json", 2, extra_env=env)
    _launch(config_doc(run, data=data, training={**training, **ROLLBACK_CFG}), run / "cfg.json", 2, extra_env=env)
    state = json.loads((run / "run" / "training_state.json").read_text())
    (event,) = [e for e in state["events"] if e["kind"] == "rollback"]
    assert event["step"] == 23 and event["detail"]["restored_step"] == 20
    assert [r["row"] for r in event["detail"]["rows"]] == list(BAD)
    parts = 2 if sharding == "full" else 1  # hybrid: a part per rank of a shard group (one rank each here)
    assert (run / "run" / f"checkpoint-step-20.part-{parts - 1}-of-{parts}.safetensors").is_file()
    assert state["status"] == "finished"
    a, b = _weights(ref / "run", 30), _weights(run / "run", 30)
    assert all(torch.equal(a[k], b[k]) for k in a)  # weights and AdamW moments


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["standard", "interleaved"])
def test_fp16_loss_scaling_on_shards_skips_and_backs_off_as_data_parallel_does(tmp_path, engine):
    """fp16 with a loss scale of 2^24: the first steps overflow, are skipped on every rank and halve
    the scale; full sharding makes the same decisions as plain data parallelism (none) on the same
    2 ranks and ends at its weights. Tolerance 1e-5, ten times fp32's: fp16's rounding amplifies
    the different order of the reduce-scatter's sums (measured 1.4e-6 with the overflows, 1.5e-7
    without; with accumulation 2 it reached 5.9e-4 between the two, each 5e-3 from one process
    with twice the batch, so no accumulation here)."""
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 10, "save_interval": 10, "eval_interval": 0, "engine": engine,
              "grad_clip": 0.5, "mixed_precision": "fp16"}
    env = {"APR_TEST_LOSS_SCALE": str(2.0**24)}
    ddp = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT, training={**common, "output_dir": "ddp/"})
    two = config_doc(tmp_path, data={"batch_size": 2}, optimizer=OPT,
                     training={**common, "output_dir": "two/", "sharding": "full"})
    _launch(ddp, tmp_path / "ddp.json", 2, extra_env=env)
    _launch(two, tmp_path / "two.json", 2, extra_env=env)
    scalers = [json.loads((tmp_path / d / "checkpoint-step-10.json").read_text())["engine"]["loss_scaler"]
               for d in ("ddp", "two")]
    assert scalers[0] == scalers[1] and scalers[0]["skipped_steps"] > 0 and scalers[0]["scale"] < 2.0**24
    assert _rel(_weights(tmp_path / "two", 10), _weights(tmp_path / "ddp", 10)) <= 1e-5
