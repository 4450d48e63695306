"""apr/data/loader.py: shapes, determinism, exact resume, disjoint ranks, the memory-mapped cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apr.data.loader import ShardLoader
from apr.data.shards import write_dataset
from apr.errors import AprError

SEQ = 7


def numbered(path, n_rows: int, shard_rows: int = 10, seq_len: int = SEQ):
    """Shards whose row i holds i, i+1, ...: a row's first token names it."""
    rows = (np.arange(n_rows)[:, None] + np.arange(seq_len + 1)[None, :]).astype(np.uint32)
    write_dataset(path, {"train": rows}, {"seq_len": seq_len}, shard_rows)
    return path / "train"


def first_ids(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].tolist()


def test_batches_are_int64_rows_of_seq_len_plus_one(tmp_path):
    loader = ShardLoader(numbered(tmp_path / "d", 53), seq_len=SEQ, batch_size=4, seed=1)
    batch = loader.next_batch()
    assert batch.dtype == torch.int64 and batch.device.type == "cpu" and tuple(batch.shape) == (4, SEQ + 1)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, SEQ, dtype=torch.int64))  # whole rows
    assert loader.num_rows == 53 and loader.steps_per_epoch == 13 and loader.memory_mapped
    assert len(loader.shards) == 6  # rows span shards: indices are global


def test_each_epoch_is_a_seeded_permutation(tmp_path):
    path = numbered(tmp_path / "d", 40)
    loader = ShardLoader(path, seq_len=SEQ, batch_size=5, seed=3, gradient_accumulation=2)
    assert loader.steps_per_epoch == 4 and loader.micro_batches_per_epoch == 8
    epochs = [[i for _ in range(8) for i in first_ids(loader.next_batch())] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(40)) and epochs[0] != epochs[1]
    assert loader.epoch == 1
    again = ShardLoader(path, seq_len=SEQ, batch_size=5, seed=3, gradient_accumulation=2)
    assert [i for _ in range(8) for i in first_ids(again.next_batch())] == epochs[0]
    other = ShardLoader(path, seq_len=SEQ, batch_size=5, seed=4, gradient_accumulation=2)
    assert [i for _ in range(8) for i in first_ids(other.next_batch())] != epochs[0]
    plain = ShardLoader(path, seq_len=SEQ, batch_size=5, shuffle=False)
    assert [i for _ in range(8) for i in first_ids(plain.next_batch())] == list(range(40))


@pytest.mark.parametrize("stop_after", [0, 3, 8, 11, 16, 23])
def test_a_restored_cursor_continues_exactly(tmp_path, stop_after):
    path = numbered(tmp_path / "d", 43)  # 43 rows, 8 per step: 3 rows dropped per epoch
    kw = dict(seq_len=SEQ, batch_size=4, seed=9, gradient_accumulation=2)
    straight = ShardLoader(path, **kw)
    expected = [straight.next_batch() for _ in range(30)]
    first = ShardLoader(path, **kw)
    for _ in range(stop_after):
        first.next_batch()
    state = first.state_dict()
    import json

    resumed = ShardLoader(path, **kw)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # it travels as JSON in a checkpoint
    for want in expected[stop_after:]:
        assert torch.equal(resumed.next_batch(), want)
    assert resumed.state_dict() == straight.state_dict()


def test_ranks_are_disjoint_and_cover_each_epoch(tmp_path):
    path = numbered(tmp_path / "d", 50)
    world = 3
    loaders = [ShardLoader(path, seq_len=SEQ, batch_size=2, seed=5, rank=r, world_size=world,
                           gradient_accumulation=2) for r in range(world)]
    assert {ld.steps_per_epoch for ld in loaders} == {4} and loaders[0].micro_batches_per_epoch == 8
    for epoch in range(2):
        taken = [[i for _ in range(8) for i in first_ids(ld.next_batch())] for ld in loaders]
        flat = [i for rank in taken for i in rank]
        assert len(flat) == len(set(flat)) == 48  # disjoint; 2 of 50 rows left for this epoch
        single = ShardLoader(path, seq_len=SEQ, batch_size=2 * world, seed=5, gradient_accumulation=2)
        single.epoch = epoch
        assert sorted(flat) == sorted(i for _ in range(8) for i in first_ids(single.next_batch()))
    # the cursor is the same on every rank, so rank 0's saved state restores all of them
    assert len({tuple(sorted(ld.state_dict().items())) for ld in loaders}) == 1


def test_a_cursor_from_another_layout_is_refused(tmp_path):
    path = numbered(tmp_path / "d", 40)
    state = ShardLoader(path, seq_len=SEQ, batch_size=4).state_dict()
    for change in (dict(batch_size=5), dict(seed=1), dict(world_size=2), dict(gradient_accumulation=2)):
        loader = ShardLoader(path, seq_len=SEQ, **{"batch_size": 4, **change})
        with pytest.raises(AprError, match=next(iter(change))):
            loader.load_state_dict(state)
    with pytest.raises(AprError, match="num_rows"):
        ShardLoader(numbered(tmp_path / "e", 41), seq_len=SEQ, batch_size=4).load_state_dict(state)


def test_sequential_iteration_leaves_the_cursor_alone(tmp_path):
    path = numbered(tmp_path / "d", 23)
    loader = ShardLoader(path, seq_len=SEQ, batch_size=4, seed=2)
    loader.next_batch()
    state = loader.state_dict()
    assert [first_ids(b) for b in loader.iter_sequential()] == [list(range(i, i + 4)) for i in range(0, 20, 4)]
    assert len(list(loader.iter_sequential(max_batches=2))) == 2
    # keep_tail: the 3 rows after the last whole batch come as a smaller last batch
    assert [first_ids(b) for b in loader.iter_sequential(keep_tail=True)][-1] == [20, 21, 22]
    assert len(list(loader.iter_sequential(max_batches=5, keep_tail=True))) == 5
    r1 = ShardLoader(path, seq_len=SEQ, batch_size=2, rank=1, world_size=2)
    assert [first_ids(b) for b in r1.iter_sequential()][:2] == [[2, 3], [6, 7]]
    assert loader.state_dict() == state


def test_the_token_cache_is_reused_and_follows_rewritten_shards(tmp_path):
    cache = tmp_path / "cache"
    path = numbered(tmp_path / "d", 30, shard_rows=30)
    first = ShardLoader(path, seq_len=SEQ, batch_size=2, shuffle=False, cache_dir=cache)
    assert first.memory_mapped and isinstance(first._rows, np.memmap)
    assert len(list(cache.glob("*.u32"))) == 1
    assert first_ids(first.next_batch()) == [0, 1]
    rows = (100 + np.arange(30)[:, None] + np.arange(SEQ + 1)[None, :]).astype(np.uint32)
    write_dataset(tmp_path / "d", {"train": rows}, {}, 30)  # same path, new content
    second = ShardLoader(path, seq_len=SEQ, batch_size=2, shuffle=False, cache_dir=cache)
    assert first_ids(second.next_batch()) == [100, 101]
    assert len(list(cache.glob("*.u32"))) == 1  # the stale entry was pruned
    in_memory = ShardLoader(path, seq_len=SEQ, batch_size=2, shuffle=False, cache_dir=False)
    assert not in_memory.memory_mapped and first_ids(in_memory.next_batch()) == [100, 101]
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    fallback = ShardLoader(path, seq_len=SEQ, batch_size=2, shuffle=False, cache_dir=blocked / "x")
    assert not fallback.memory_mapped and first_ids(fallback.next_batch()) == [100, 101]


def test_shards_of_another_seq_len_or_column_are_refused(tmp_path):
    path = numbered(tmp_path / "d", 20)
    with pytest.raises(AprError, match="seq_len \\+ 1 = 9"):
        ShardLoader(path, seq_len=8, batch_size=2)
    with pytest.raises(AprError, match="no column 'tokens'"):
        ShardLoader(path, seq_len=SEQ, batch_size=2, input_column="tokens")
    with pytest.raises(AprError, match="no Parquet shards"):
        ShardLoader(tmp_path / "empty", seq_len=SEQ, batch_size=2)
    small = ShardLoader(path, seq_len=SEQ, batch_size=32)
    assert small.steps_per_epoch == 0
    with pytest.raises(AprError, match="fewer than one optimizer step"):
        small.next_batch()


def _unstatted_shard(path, rows: np.ndarray, type_):
    """One shard written without Parquet statistics (the plan cannot see its ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True)
    n, width = rows.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    col = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1), type=type_))
    pq.write_table(pa.table({"input_ids": col}), path / "a.parquet", write_statistics=False)
    return path


@pytest.mark.parametrize("cache", [True, False])
def test_ids_beyond_vocab_size_fail_naming_shard_and_row(tmp_path, cache):
    import pyarrow as pa

    rows = np.ones((12, SEQ + 1), dtype=np.uint32)
    rows[9, 3] = 5000  # was an IndexError in the embedding, mid-run
    path = _unstatted_shard(tmp_path / "d", rows, pa.uint32())
    loader = ShardLoader(path, seq_len=SEQ, batch_size=12, vocab_size=4096, shuffle=False,
                         cache_dir=(tmp_path / "cache") if cache else False)
    with pytest.raises(AprError) as e:
        loader.next_batch()
    f = e.value.findings[0]
    assert f.code == "data.token_id" and f.file.endswith("a.parquet") and "row 9" in f.message
    assert f.got == "5000 at row 9, position 3" and f.expected == "token ids < 4096"
    ok = ShardLoader(path, seq_len=SEQ, batch_size=12, vocab_size=8192, shuffle=False, cache_dir=False)
    assert ok.next_batch().max().item() == 5000


def test_negative_ids_in_a_signed_column_fail_naming_shard_and_row(tmp_path):
    import pyarrow as pa

    rows = np.ones((6, SEQ + 1), dtype=np.int64)
    rows[4, 0] = -3  # would wrap to 4294967293 as uint32
    path = _unstatted_shard(tmp_path / "d", rows, pa.int64())
    with pytest.raises(AprError) as e:
        ShardLoader(path, seq_len=SEQ, batch_size=2, vocab_size=4096, cache_dir=False)
    f = e.value.findings[0]
    assert f.code == "data.token_id" and "row 4" in f.message and f.got.startswith("-3 at row 4")


def test_junk_in_the_cache_folder_is_skipped_not_read(tmp_path):
    import os

    cache = tmp_path / "cache"
    cache.mkdir()
    os.mkfifo(cache / "fifo.json")  # reading it would block the loader forever
    (cache / "list.json").write_text("[1, 2]")
    (cache / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    loader = ShardLoader(numbered(tmp_path / "d", 20), seq_len=SEQ, batch_size=4, cache_dir=cache)
    assert loader.memory_mapped and loader.next_batch().shape == (4, SEQ + 1)
    assert (cache / "list.json").exists() and (cache / "fifo.json").exists()


def test_drift_samples_split_the_epoch_at_the_cursor_across_ranks(tmp_path):
    """sample_read_and_ahead: every rank's rows given out so far on one side, the rest of the epoch
    on the other; nothing at an epoch's start; the cursor is not moved."""
    path = numbered(tmp_path / "d", 40)
    loader = ShardLoader(path, seq_len=SEQ, batch_size=2, rank=1, world_size=2, seed=5, cache_dir=False)
    rng = np.random.default_rng(0)
    assert loader.sample_read_and_ahead(100, rng) is None
    given = set()
    for _ in range(3):
        given |= set(first_ids(loader.next_batch()))
    read, ahead = loader.sample_read_and_ahead(100, rng)
    state = loader.state_dict()
    read_ids, ahead_ids = set(read[:, 0].tolist()), set(ahead[:, 0].tolist())
    assert len(read_ids) == 12 and given < read_ids  # rank 0's rows too
    assert read_ids == set(loader._order()[:12].tolist()) and ahead_ids == set(loader._order()[12:40].tolist())
    assert len(loader.sample_read_and_ahead(5, rng)[1]) == 5 and loader.state_dict() == state


def _targets_shard(path, ids: np.ndarray, targets: np.ndarray | None, name: str = "a.parquet"):
    """A shard of ``input_ids`` and (unless None) a list<int32> ``targets`` column beside them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True, exist_ok=True)
    n, width = ids.shape
    offsets = pa.array(np.arange(0, (n + 1) * width, width, dtype=np.int32))
    columns = {"input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.reshape(-1), type=pa.uint32()))}
    if targets is not None:
        columns["targets"] = pa.ListArray.from_arrays(offsets, pa.array(targets.reshape(-1), type=pa.int32()))
    pq.write_table(pa.table(columns), path / name)
    return path


def test_a_targets_column_comes_beside_each_rows_ids_and_out_of_range_targets_fail_naming_the_row(tmp_path):
    """training.mode custom: each batch row is the row's ids then its targets (-100 kept); a target
    that is neither -100 nor below vocab_size fails when the loader opens the shard, naming it."""
    ids = (np.arange(6)[:, None] + np.arange(SEQ + 1)[None, :]).astype(np.uint32)
    targets = (ids.astype(np.int32) * 2) % 50
    targets[2, 5] = -100
    path = _targets_shard(tmp_path / "d", ids, targets)
    loader = ShardLoader(path, seq_len=SEQ, batch_size=3, shuffle=False, vocab_size=64, targets_column="targets")
    batch = loader.next_batch()
    assert tuple(batch.shape) == (3, 2 * (SEQ + 1))
    assert batch[:, :SEQ + 1].tolist() == ids[:3].tolist() and batch[:, SEQ + 1:].tolist() == targets[:3].tolist()
    assert batch[2, SEQ + 1 + 5].item() == -100
    targets[4, 1] = 64
    bad = _targets_shard(tmp_path / "e", ids, targets)
    with pytest.raises(AprError) as e:
        ShardLoader(bad, seq_len=SEQ, batch_size=3, vocab_size=64, targets_column="targets", cache_dir=False)
    f = e.value.findings[0]
    assert f.code == "data.target" and f.file.endswith("a.parquet") and f.got == "64 at row 4, position 1"
    assert f.path == "training.custom.targets_column" and "-100" in f.expected
    with pytest.raises(AprError, match="no column 'labels'") as e:
        ShardLoader(path, seq_len=SEQ, batch_size=3, targets_column="labels")
    assert e.value.findings[0].path == "training.custom.targets_column"
