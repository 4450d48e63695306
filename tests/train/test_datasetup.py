"""The run's data side (apr/train/datasetup.py): the step count and tokens per step are the plan's
(apr.steps.algebra), the LR schedule spans exactly those steps (a wsd decay starting where
training.decay_stage starts), a mixture config gets the mixture loader with the plan's stages and
token shares, and data too small for one step is refused with its key."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from apr.data.loader import ShardLoader
from apr.data.mixloader import MixtureLoader
from apr.data.shards import write_dataset
from apr.errors import AprError
from apr.plan.build import build_plan
from apr.plan.examples import to_yaml
from apr.train.datasetup import data_side, micro_batches
from tests.train.run_helpers import BASE, SEQ, VOCAB, make_dataset, merge, write_config


class Rank:
    """Where data_side reads the layout from: this process's rank of ``world_size``."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def _side(plan, dp=None):
    """The loader data_side builds for the plan's Resolved, with the step counts and schedule the run
    takes from that Resolved."""
    warnings: list[str] = []
    resolved = plan.resolved
    side = data_side(resolved, dp, warnings.append)
    steps = resolved.steps
    assert side.loader.steps_per_epoch == steps.steps_per_epoch  # what the loader reads is what was planned
    return SimpleNamespace(loader=side.loader, mixture=side.mixture, loader_options=side.loader_options,
                           total_steps=steps.total_steps, epoch_steps=steps.epoch_steps,
                           tokens_per_step=steps.tokens_per_step, schedule=resolved.schedule), warnings


@pytest.mark.parametrize(("accum", "epochs", "max_steps", "total"), [
    (1, 2, None, 24),  # 50 rows / 4 = 12 steps per epoch (2 rows dropped), 2 epochs
    (1, 2, 5, 5),  # max_steps below what the data gives
    (3, 2, 100, 8),  # 50 / 12 = 4 steps per epoch: the data caps max_steps
])
def test_the_step_count_and_tokens_per_step_are_the_plans(tmp_path, accum, epochs, max_steps, total):
    make_dataset(tmp_path, train_rows=50)
    plan = build_plan(write_config(tmp_path, training={"gradient_accumulation": accum, "epochs": epochs,
                                                       "max_steps": max_steps}))
    side, warnings = _side(plan)
    steps = plan.facts["steps"]
    assert isinstance(side.loader, ShardLoader) and side.mixture is False
    assert side.total_steps == steps["total_steps"] == total
    assert side.epoch_steps == steps["epoch_steps"] == epochs * steps["steps_per_epoch"]
    assert side.tokens_per_step == steps["tokens_per_step"] == 4 * accum * SEQ
    assert side.loader.steps_per_epoch == steps["steps_per_epoch"]
    assert warnings == []


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_the_schedule_warms_up_then_ends_at_min_lr_on_the_last_step(tmp_path, kind):
    """The schedule is built on the run's total steps (max_steps 10 of the 48 the data gives): the
    decay reaches min_lr on step 10, not on step 48."""
    make_dataset(tmp_path)
    plan = build_plan(write_config(tmp_path, training={"max_steps": 10, "warmup_steps": 2, "lr_scheduler": kind}))
    side, _ = _side(plan)
    lr, min_lr = plan.config.optimizer.lr, plan.config.optimizer.min_lr
    assert side.total_steps == 10 and side.epoch_steps == 48
    assert side.schedule(1) == pytest.approx(lr / 2) and side.schedule(2) == pytest.approx(lr)
    assert side.schedule(10) == pytest.approx(min_lr) and side.schedule(9) > min_lr
    lrs = [side.schedule(s) for s in range(2, 11)]
    assert lrs == sorted(lrs, reverse=True)  # no rise after the warmup
    assert plan.facts["steps"]["peak_lr_reached"] == pytest.approx(max(lrs))


def test_a_rank_of_two_reads_its_own_rows_and_the_steps_are_the_plans_for_two(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": None, "epochs": 1})
    one, _ = _side(build_plan(cfg))
    plan2 = build_plan(cfg, world_size=2)
    rank0, _ = _side(plan2, Rank(0, 2))
    rank1, _ = _side(plan2, Rank(1, 2))
    assert one.total_steps == 24 and rank0.total_steps == rank1.total_steps == 12  # 96 rows / (4 x 2 ranks)
    assert rank1.total_steps == plan2.facts["steps"]["total_steps"]
    assert rank1.tokens_per_step == plan2.facts["steps"]["tokens_per_step"] == 2 * one.tokens_per_step
    assert (rank1.loader_options["rank"], rank1.loader_options["world_size"]) == (1, 2)
    first0, first1 = rank0.loader.next_batch(), rank1.loader.next_batch()
    assert not first0.equal(first1)  # the two ranks' halves of one global batch
    assert first0.equal(one.loader.next_batch())  # rank 0 reads the first rows of the same shuffle


def test_fewer_rows_than_one_step_is_refused_at_data_train(tmp_path):
    make_dataset(tmp_path, train_rows=6)
    cfg = write_config(tmp_path, training={"gradient_accumulation": 2})
    with pytest.raises(AprError, match=r"6 sequences are fewer than one optimizer step needs \(8 = batch_size x "
                                       r"gradient_accumulation x world_size\)") as err:
        data_side(build_plan(cfg).resolved, None, print)
    finding = err.value.findings[0]
    assert (finding.code, finding.path) == ("apply.data", "data.train")
    assert finding.file == str(tmp_path / "data" / "train")


def _source(folder, rows: int, seed: int, documents: int | None = None) -> None:
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCAB, size=rows + 4)
    data = ((starts[:, None] + np.arange(SEQ + 1)[None, :]) % VOCAB).astype(np.uint32)
    manifest = {"seq_len": SEQ, "row_len": SEQ + 1, "tokenizer": {"sha256": "t" * 64},
                "documents": documents or rows, "tokens_total": (rows + 4) * (SEQ + 1)}
    write_dataset(folder, {"train": data[:rows], "val": data[rows:]}, manifest, 16)


def _mixture_plan(root, *, data=None, training=None):
    for i, (name, rows) in enumerate((("web", 40), ("code", 24))):
        _source(root / name, rows, seed=10 + i, documents=(rows + 4) // (4 if name == "web" else 1))
    sources = [{"name": "web", "path": str(root / "web/train"), "weight": 0.5},
               {"name": "code", "path": str(root / "code/train"), "weight": 0.5}]
    doc = merge(BASE, {"data": {"train": sources, "val": None, **(data or {})},
                       "training": {"output_dir": str(root / "run"), "epochs": 1, "max_steps": None,
                                    **(training or {})}})
    path = root / "cfg.yaml"
    path.write_text(to_yaml(doc))
    return build_plan(path)


def test_a_mixture_gets_the_mixture_loader_switching_stage_at_the_planned_step(tmp_path):
    stages = [{"name": "main", "start": 0, "weights": {"web": 0.5, "code": 0.5}},
              {"name": "decay", "start": 0.5, "weights": {"code": 1.0}}]
    plan = _mixture_plan(tmp_path, data={"stages": stages}, training={"gradient_accumulation": 2})
    side, _ = _side(plan)
    assert isinstance(side.loader, MixtureLoader) and side.mixture is True
    assert side.loader.num_rows == 64  # an epoch of a mixture: every source's rows
    assert side.total_steps == plan.facts["steps"]["total_steps"] == 8  # 64 rows / (4 x 2)
    start = plan.facts["mixture"]["stage_starts"][1]
    assert start == 4
    for _ in range(start * 2):  # the micro-batches of steps 1..4
        side.loader.next_batch()
    assert side.loader.stage == 0
    side.loader.next_batch()  # step 5's first
    assert side.loader.stage == 1 and side.loader.stage_name == "decay"


def test_a_wsd_decay_starts_where_the_decay_stage_starts(tmp_path):
    """decay_stage 'decay' starting at half the run: peak up to step 8 of 16, then linear to min_lr
    (decay_fraction's default 0.2 would have held the peak until step 13)."""
    stages = [{"name": "main", "start": 0, "weights": {"web": 0.5, "code": 0.5}},
              {"name": "decay", "start": 0.5, "weights": {"code": 1.0}}]
    plan = _mixture_plan(tmp_path, data={"stages": stages},
                         training={"lr_scheduler": "wsd", "decay_stage": "decay", "warmup_steps": 0})
    side, _ = _side(plan)
    lr, min_lr = plan.config.optimizer.lr, plan.config.optimizer.min_lr
    assert side.total_steps == 16 and plan.facts["mixture"]["stage_starts"][1] == 8
    assert [side.schedule(s) for s in (1, 8)] == [lr, lr]
    assert side.schedule(9) < lr
    assert side.schedule(12) == pytest.approx(min_lr + (lr - min_lr) * 4 / 8)
    assert side.schedule(16) == pytest.approx(min_lr)


def test_document_weights_reach_the_loader_as_the_plans_token_shares(tmp_path):
    """weight_unit documents: a web document is 4 rows, a code document 1, so equal document weights
    draw 4x the tokens from web."""
    plan = _mixture_plan(tmp_path, data={"weight_unit": "documents"})
    side, _ = _side(plan)
    weights = side.loader.stages[0].weights
    shares = {n: w / sum(weights.values()) for n, w in weights.items()}
    assert shares == pytest.approx(plan.facts["mixture"]["stages"][0]["token_shares"])
    assert shares == pytest.approx({"web": 0.8, "code": 0.2})


def test_a_mixture_too_small_for_one_step_is_refused(tmp_path):
    plan = _mixture_plan(tmp_path, data={"batch_size": 40}, training={"gradient_accumulation": 2})
    with pytest.raises(AprError, match=r"^the mixture: 64 sequences are fewer than one optimizer step needs \(80 "):
        data_side(plan.resolved, None, print)


class Batch:
    def __init__(self, i: int):
        self.i, self.pinned = i, False

    def pin_memory(self):
        pinned = Batch(self.i)
        pinned.pinned = True
        return pinned


class Counter:
    def __init__(self):
        self.taken = 0

    def next_batch(self):
        self.taken += 1
        return Batch(self.taken)


@pytest.mark.parametrize("pin", [False, True])
def test_a_steps_micro_batches_are_pinned_only_for_a_cuda_run(pin):
    """A CUDA run's batches go to the device from page-locked memory (a copy queued on the stream, no
    host wait for the previous step); a CPU run's are the loader's own tensors."""
    loader = Counter()
    batches = micro_batches(loader, 3, pin)
    assert [b.i for b in batches] == [1, 2, 3] and loader.taken == 3
    assert all(b.pinned is pin for b in batches)
