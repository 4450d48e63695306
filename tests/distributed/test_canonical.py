"""training.reduction: canonical (apr/train/reduction.py) across layouts on gloo, on both gradient sources
(autograd and the flat-buffer walk): 2 ranks with accumulation 2 (DDP, or FSDP2 full shards), one process
with accumulation 4, and a 2-rank run resumed on one process end with the same bits, and measure the same
validation losses (apr/train/validation.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from apr.checkpoint import parts  # noqa: E402
from tests.distributed.ranks import run_ranks, run_script  # noqa: E402

WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"


def _launch(doc: dict, path: Path, nproc: int, resume: str | None = None) -> None:
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120"}
    proc = run_ranks(args, nproc, env, timeout=240) if nproc > 1 else run_script(args, env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The checkpoint's whole tensors: one file, or a sharded run's parts (each rank's rows) joined."""
    stem = f"checkpoint-step-{step}"
    found = parts.parts_of(run_dir, stem)
    return parts.load(found, lambda name: True) if found else load_file(str(run_dir / f"{stem}.safetensors"))


def _bitwise(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


def _val_losses(run_dir: Path) -> list:
    return json.loads((run_dir / "training_state.json").read_text())["val_loss_history"]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "sharding", "clip_mode"), [
    ("standard", "none", "global"), ("standard", "full", "global"), ("standard", "full", "adagc"),
    ("interleaved", "none", "per_block"), ("interleaved", "full", "adagc")],
    ids=["ddp-standard-global", "full-standard-global", "full-standard-adagc", "ddp-interleaved-per_block",
         "full-interleaved-adagc"])
def test_two_ranks_one_process_and_a_resume_on_fewer_ranks_end_bitwise_equal(tmp_path, engine, sharding, clip_mode):
    make_dataset(tmp_path, train_rows=160)
    # 3 validation micro-batches: on 2 ranks one scores two, the other one (and one it does not count)
    common = {"epochs": 1, "max_steps": 8, "save_interval": 4, "keep_last": 5, "eval_interval": 4,
              "eval_batches": 3, "engine": engine, "reduction": "canonical", "grad_clip": 0.5,
              "clip_mode": clip_mode, "sharding": sharding}
    opt = {"lr": 1e-2, "min_lr": 1e-3}  # an lr at which fast's rank-dependent rounding shows by step 8

    def doc(out: str, accum: int) -> dict:
        return config_doc(tmp_path, data={"batch_size": 2}, optimizer=opt,
                          training={**common, "gradient_accumulation": accum, "output_dir": out})

    _launch(doc("two/", 2), tmp_path / "two.json", 2)  # global micro-batches j = k * 2 + rank
    _launch(doc("one/", 4), tmp_path / "one.json", 1)  # the same 4 micro-batches a step, j = k
    _bitwise(_state(tmp_path / "one", 8), _state(tmp_path / "two", 8))
    val_two = _val_losses(tmp_path / "two")
    assert [step for step, _ in val_two] == [0, 4, 8] and val_two == _val_losses(tmp_path / "one")
    # the 2-rank run killed after its step-4 checkpoint, resumed on one process (elastic: accumulation 4)
    (tmp_path / "resumed").mkdir()
    for path in (tmp_path / "two").glob("checkpoint-step-4.*"):  # the JSON and the weights (or their parts)
        shutil.copy(path, tmp_path / "resumed")
    _launch(doc("resumed/", 2), tmp_path / "resumed.json", 1, resume="latest")
    _bitwise(_state(tmp_path / "resumed", 8), _state(tmp_path / "two", 8))


def _orchestrator_history(run_dir: Path, step: int) -> list:
    return json.loads((run_dir / f"checkpoint-step-{step}.json").read_text())["orchestrator"]["history"]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "sharding"), [("standard", "none"), ("standard", "full"), ("interleaved", "full")],
                         ids=["ddp", "full", "full-interleaved"])
def test_orchestrated_two_ranks_and_one_process_pick_the_same_branches_and_end_bitwise_equal(tmp_path, engine,
                                                                                              sharding):
    """The orchestrator's rewards are the canonical validation loss (the same first eval_batches
    micro-batches, one tree) and its branch losses the tree's step losses: 2 ranks x 2 and one process x 4
    record the same decisions to the bit (every branch's val loss, reward and training losses; on shards
    a nowcast extrapolated from each rank's rows) and end with the same weights and moments."""
    make_dataset(tmp_path, train_rows=160)
    common = {"epochs": 1, "max_steps": 10, "save_interval": 7, "keep_last": 5, "eval_interval": 5,
              "eval_batches": 3, "engine": engine, "reduction": "canonical", "grad_clip": 0.5,
              "sharding": sharding,
              "orchestrator": {"enabled": True, "decision_interval": 4, "eval_horizon": 2, "branches": 2,
                               "candidates": ["conservative_adamw", "aggressive_adamw", "spike_resistant"],
                               "nowcasting": {"enabled": sharding == "full"}}}
    opt = {"lr": 1e-2, "min_lr": 1e-3}

    def doc(out: str, accum: int) -> dict:
        return config_doc(tmp_path, data={"batch_size": 2}, optimizer=opt,
                          training={**common, "gradient_accumulation": accum, "output_dir": out})

    _launch(doc("two/", 2), tmp_path / "two.json", 2)
    _launch(doc("one/", 4), tmp_path / "one.json", 1)
    two, one = _orchestrator_history(tmp_path / "two", 10), _orchestrator_history(tmp_path / "one", 10)
    assert [d["step"] for d in two] == [4, 8] and len(two[0]["branches"]) == 2
    if sharding == "full":  # the nowcast over steps 4 and 8 was kept: step 10's weights went through it
        assert two[1]["nowcast"] is not None and two[1]["nowcast"]["history"] == [4, 8]
    assert two == one  # every branch's val loss, reward, training losses; the winners, the bandit
    _bitwise(_state(tmp_path / "one", 10), _state(tmp_path / "two", 10))
    # the 2-rank run resumed on one process between its decisions: the nowcast point of step 4 (on shards,
    # each rank's rows in a file of its own) is read back whole, and the nowcast at step 8 is the same
    (tmp_path / "resumed").mkdir()
    for path in (tmp_path / "two").glob("checkpoint-step-7.*"):
        shutil.copy(path, tmp_path / "resumed")
    if (tmp_path / "two" / ".apr" / "nowcast").is_dir():
        shutil.copytree(tmp_path / "two" / ".apr" / "nowcast", tmp_path / "resumed" / ".apr" / "nowcast")
    _launch(doc("resumed/", 2), tmp_path / "resumed.json", 1, resume="latest")
    assert _orchestrator_history(tmp_path / "resumed", 10) == two
    _bitwise(_state(tmp_path / "resumed", 10), _state(tmp_path / "two", 10))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A 4-block model trained 2 steps: the distillation tests' teacher (a run folder)."""
    root = tmp_path_factory.mktemp("teacher")
    make_dataset(root, train_rows=32)
    doc = config_doc(root, model={"architecture": {"num_hidden_layers": 4}},
                     training={"max_steps": 2, "save_interval": 2, "eval_interval": 0, "output_dir": "base/"})
    _launch(doc, root / "base.json", 1)
    return root / "base"


def _engine_meta(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / f"checkpoint-step-{step}.json").read_text())["engine"]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"], ids=["ddp", "full"])
def test_distillation_on_two_ranks_and_one_process_decides_alike_and_ends_bitwise_equal(tmp_path, teacher, sharding):
    """Both phases of blockwise distillation under canonical: phase 1's blocks end on the tree's step loss
    (convergence patience; autotune's active LR factors too), every rank and layout alike; 2 ranks x 2 and
    one process x 4 end with the same weights, moments, block ends and autotune state, and the 2-rank run
    resumed from its step-4 checkpoint on one process ends with the same bits."""
    make_dataset(tmp_path, train_rows=160)
    distill = {"teacher": str(teacher), "phase1_steps": 3, "convergence_patience": 1, "init_from_teacher": True,
               "autotune": {"mode": "active", "plateau_patience": 1}}
    common = {"epochs": 1, "max_steps": 9, "save_interval": 4, "keep_last": 5, "eval_interval": 4,
              "eval_batches": 3, "engine": "standard", "reduction": "canonical", "grad_clip": 0.5,
              "sharding": sharding, "mode": "distill", "distill": distill}

    def doc(out: str, accum: int) -> dict:
        return config_doc(tmp_path, data={"batch_size": 2}, optimizer={"lr": 1e-2, "min_lr": 1e-3},
                          training={**common, "gradient_accumulation": accum, "output_dir": out})

    _launch(doc("two/", 2), tmp_path / "two.json", 2)
    _launch(doc("one/", 4), tmp_path / "one.json", 1)
    meta = _engine_meta(tmp_path / "two", 8)
    assert meta["engine"] == "distill" and meta["distill_phase"][0] == 2  # phase 2 reached
    assert meta["autotune"] == _engine_meta(tmp_path / "one", 8)["autotune"]
    assert meta["phase1"] == _engine_meta(tmp_path / "one", 8)["phase1"]
    _bitwise(_state(tmp_path / "one", 8), _state(tmp_path / "two", 8))
    assert _val_losses(tmp_path / "two") == _val_losses(tmp_path / "one")
    (tmp_path / "resumed").mkdir()
    for path in (tmp_path / "two").glob("checkpoint-step-4.*"):
        shutil.copy(path, tmp_path / "resumed")
    _launch(doc("resumed/", 2), tmp_path / "resumed.json", 1, resume="latest")
    _bitwise(_state(tmp_path / "resumed", 8), _state(tmp_path / "two", 8))


def test_each_rank_summing_a_slice_of_every_leaf_gives_the_whole_trees_bits(tmp_path):
    """Replicated canonical (``CanonicalSum`` on several ranks): each rank sums its slice of every
    global micro-batch's leaf (padded where the world size does not divide the gradient's length) and
    the slices are gathered; the mean and the loss are the bits one process's tree gives."""
    from apr.train.reduction import tree_sum

    world, numel, accum = 3, 1001, 2  # 1001 = 3 x 333 + 2: the last slice is padded
    out = tmp_path / "mean.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "60"}
    worker = Path(__file__).resolve().parent / "slices_worker.py"
    proc = run_ranks([str(worker), str(out), str(numel), str(accum)], world, env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    leaves = []
    for j in range(world * accum):
        g = torch.Generator().manual_seed(1000 + j)
        leaves.append(torch.cat([torch.randn(numel - 7, generator=g), torch.randn(7, generator=g)]))
    got = torch.load(out)
    n = len(leaves)
    assert got["mean"].shape == (numel,) and torch.equal(got["mean"], tree_sum(leaves) / n)
    losses = [torch.tensor([float(j) / 3]) for j in range(n)]
    assert torch.equal(got["loss"], (tree_sum(losses) / n).reshape(()))
