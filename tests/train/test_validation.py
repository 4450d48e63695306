"""Validation during a run (apr/train/validation.py): the loss over the first ``eval_batches`` of
data.val in stored order, the ranks' sums combined before dividing, a mixture's per-source val
folders, "best" meaning strictly lower than every earlier loss (the initial weights included), and
best/first travelling in the checkpoint (a stateful part)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from apr.config.schema import AprConfig
from apr.data.shards import write_dataset
from apr.plan.build import resolve_config
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from apr.train.datasetup import data_side
from apr.train.validation import Validation
from tests.train.run_helpers import BASE, SEQ, VOCAB, config_doc, make_dataset, merge

CPU = torch.device("cpu")


class _Engine:
    """What validation reads of an engine besides its loss: the model (put in eval mode while it
    measures) and the loss part (None: scored by ``eval_loss_sum``)."""

    loss = None

    def __init__(self):
        self.model = torch.nn.Linear(1, 1)
        self.modes: list[bool] = []  # the model's training flag at each val batch


class Scripted(_Engine):
    """An engine whose every val batch has the loss ``value`` per row (and counts the batches it saw)."""

    def __init__(self, value: float = 2.0):
        super().__init__()
        self.value, self.batches = value, 0

    def eval_loss_sum(self, batch):
        self.batches += 1
        self.modes.append(self.model.training)
        return torch.tensor(self.value * batch.shape[0], dtype=torch.float32), batch.shape[0]


class FirstToken(_Engine):
    """An engine whose loss of a row is its first token id: tells the val folders apart."""

    def eval_loss_sum(self, batch):
        return batch[:, 0].double().sum(), batch.shape[0]


class Recorded:
    def __init__(self):
        self.evals: list[tuple[int, float | None]] = []

    def log_eval(self, step, val_loss):
        self.evals.append((step, val_loss))


def _validation(root: Path, dp=None, doc: dict | None = None, **sections) -> tuple[Validation, list[str]]:
    config = AprConfig.model_validate(doc or config_doc(root, **sections))
    lines: list[str] = []
    side = data_side(resolve_config(config), None, lines.append)  # the loader options the run hands validation
    return Validation(config, side.loader_options, dp, CPU, lines.append, lambda step: f"step {step}"), lines


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    return tmp_path


def test_the_loss_is_the_mean_token_cross_entropy_over_the_first_eval_batches_of_val(root):
    val, _ = _validation(root, training={"eval_batches": 2})
    config = AprConfig.model_validate(config_doc(root))
    engine = build_engine(plan_of(config), CPU)
    # the first 2 batches x 4 rows of the val shard, in stored order (not shuffled, not the train set)
    table = pq.read_table(root / "data" / "val" / "shard-00000.parquet")
    rows = torch.tensor(np.array(table.column("input_ids").to_pylist()[:8]), dtype=torch.int64)
    with torch.no_grad():
        logits = engine.model(rows[:, :-1])
        expected = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1), reduction="sum").item()
    assert val.configured
    assert val.measure(engine) == pytest.approx(expected / (8 * SEQ), rel=1e-5)


def test_exactly_eval_batches_batches_are_read(root):
    val, _ = _validation(root, training={"eval_batches": 3})
    engine = Scripted(1.5)
    assert val.measure(engine) == pytest.approx(1.5)
    assert engine.batches == 3


def test_the_model_is_in_eval_mode_while_validation_measures_and_in_training_mode_after(root):
    """No dropout (model.architecture.dropout, LoRA's) in the validation loss."""
    val, _ = _validation(root, training={"eval_batches": 2})
    engine = Scripted(1.0)
    val.measure(engine)
    assert engine.modes == [False, False] and engine.model.training


def test_ranks_sums_and_counts_are_combined_before_dividing(root):
    """Data parallel: sum over every rank's tokens / every rank's count (not a mean of the ranks' means)."""

    class OtherRank:  # another rank measured a loss sum of 30 over 5 rows; an all-reduce, in place
        def sum_(self, both):
            both += torch.tensor([30.0, 5.0], dtype=torch.float64)
            return both

    val, _ = _validation(root, dp=OtherRank(), training={"eval_batches": 2})
    # here: 2 batches x 4 rows at loss 2.0 each = 16 over 8 rows
    assert val.measure(Scripted(2.0)) == pytest.approx((16 + 30) / (8 + 5))


def test_no_val_set_or_eval_interval_0_measures_nothing(root):
    val, lines = _validation(root, data={"val": None})
    assert not val.configured
    rec = Recorded()
    assert val.initial(Scripted(), rec) is None
    assert rec.evals == [(0, None)] and lines == []  # recorded as missing, nothing printed
    off, _ = _validation(root, training={"eval_interval": 0})
    assert not off.configured and off.measure(Scripted()) is None  # the val folder is not even opened


def test_best_is_strictly_lower_than_every_earlier_loss_the_initial_one_included(root):
    val, lines = _validation(root)
    engine, rec = Scripted(3.0), Recorded()
    assert val.initial(engine, rec) == 3.0
    assert (val.first, val.best, val.last) == (3.0, 3.0, 3.0)
    seen = []
    for step, value in [(4, 3.5), (8, 2.0), (12, 2.0), (16, 2.5)]:
        engine.value = value
        seen.append(val.at(step, engine, rec))
    assert seen == [(3.5, False), (2.0, True), (2.0, False), (2.5, False)]  # a tie is not "best"
    assert (val.first, val.best, val.last) == (3.0, 2.0, 2.5)
    assert rec.evals == [(0, 3.0), (4, 3.5), (8, 2.0), (12, 2.0), (16, 2.5)]
    assert lines[0] == "step 0  val loss 3.0000 (ppl 20.1)"  # the initial loss is never "best"
    assert [line.endswith("  best") for line in lines] == [False, False, True, False, False]


def test_best_and_first_survive_a_checkpoint_round_trip(root):
    val, _ = _validation(root)
    engine, rec = Scripted(3.0), Recorded()
    val.initial(engine, rec)
    engine.value = 2.0
    val.at(4, engine, rec)
    meta = json.loads(json.dumps(val.state_dict()))  # as a checkpoint's JSON holds it
    assert meta == {"best_val_loss": 2.0, "first_val_loss": 3.0}

    resumed, _ = _validation(root)
    resumed.load_state_dict(meta)
    assert (resumed.best, resumed.first) == (2.0, 3.0)
    engine.value = 2.25
    assert resumed.at(8, engine, rec) == (2.25, False)  # worse than the best before the resume
    engine.value = 1.75
    assert resumed.at(12, engine, rec) == (1.75, True)
    assert resumed.state_dict() == {"best_val_loss": 1.75, "first_val_loss": 3.0}

    older, _ = _validation(root)
    older.load_state_dict({"step": 4})  # a checkpoint without validation state: nothing to beat
    assert (older.best, older.first) == (None, None)
    assert older.at(8, engine, rec)[1] is True


def _constant_source(folder: Path, token: int, rows: int = 12) -> None:
    data = np.full((rows, SEQ + 1), token, dtype=np.uint32)
    manifest = {"seq_len": SEQ, "row_len": SEQ + 1, "tokenizer": {"sha256": "t" * 64}, "documents": rows,
                "tokens_total": 2 * rows * (SEQ + 1)}
    write_dataset(folder, {"train": data, "val": data}, manifest, 16)


@pytest.mark.parametrize("shared_val", [False, True])
def test_a_mixture_measures_each_sources_val_folder(tmp_path, shared_val):
    """Without data.val the loss is the plain mean of the sources' (a source without val is left out);
    with data.val that set is the loss and the sources' are still measured."""
    for name, token in (("web", 5), ("code", 9), ("books", 20)):
        _constant_source(tmp_path / name, token)
    _constant_source(tmp_path / "shared", 1)
    sources = [{"name": "web", "path": str(tmp_path / "web/train"), "weight": 0.5, "val": str(tmp_path / "web/val")},
               {"name": "code", "path": str(tmp_path / "code/train"), "weight": 0.3,
                "val": str(tmp_path / "code/val")},
               {"name": "books", "path": str(tmp_path / "books/train"), "weight": 0.2}]
    val_folder = str(tmp_path / "shared/val") if shared_val else None
    doc = merge(BASE, {"data": {"train": sources, "val": val_folder}})
    val, lines = _validation(tmp_path, doc=doc)
    assert val.configured
    assert val.measure(FirstToken()) == (1.0 if shared_val else (5 + 9) / 2)
    assert val.by_source == {"web": 5.0, "code": 9.0}
    val.at(4, FirstToken(), Recorded())
    assert lines[-1] == "step 4  val loss by source: web 5.0000  code 9.0000"


def test_canonical_reads_the_same_micro_batches_on_any_layout_each_rank_scoring_its_share(root, monkeypatch):
    """training.reduction: canonical: the first eval_batches micro-batches of batch_size rows whatever the
    world size; micro-batch j scored by rank j % world (a rank short of one scores the first again, never
    counted), then every rank's sums added in the fixed tree over j (apr/train/reduction.py)."""
    fast, _ = _validation(root, training={"eval_batches": 3})
    one, _ = _validation(root, training={"eval_batches": 3, "reduction": "canonical"})
    assert one.measure(FirstToken()) == fast.measure(FirstToken())  # one process: fast's rows

    class RankOneOfTwo:
        rank, world_size = 1, 2

    seen = {}

    def tree(dp, local, count):  # what rank 1 hands the collective
        seen.update(local=[t.tolist() for t in local], count=count)
        return torch.tensor([1.0, 1.0], dtype=torch.float64)

    monkeypatch.setattr("apr.train.validation.canonical_sums", tree)
    two, _ = _validation(root, dp=RankOneOfTwo(), training={"eval_batches": 3, "reduction": "canonical"})
    two.measure(FirstToken())
    table = pq.read_table(root / "data" / "val" / "shard-00000.parquet")
    first = [row[0] for row in table.column("input_ids").to_pylist()]
    batch = BASE["data"]["batch_size"]
    # micro-batch 1 (its rows 4..7), then micro-batch 0 again as padding; 3 micro-batches are summed
    assert seen == {"count": 3, "local": [[float(sum(first[batch:2 * batch])), float(batch)],
                                          [float(sum(first[:batch])), float(batch)]]}
