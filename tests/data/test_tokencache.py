"""apr/data/tokencache.py: a damaged token cache is never trained on; it is rebuilt from the shards."""

from __future__ import annotations

import os

import numpy as np
import pytest

from apr.data import tokencache
from apr.data.loader import ShardLoader, TokenCacheWarning
from apr.data.shards import write_dataset

SEQ = 7


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(tokencache, "BLOCK_BYTES", 256)  # 8 rows of 32 bytes per block: many blocks


def dataset(tmp_path, n_rows=100, offset=0):
    rows = (offset + np.arange(n_rows)[:, None] + np.arange(SEQ + 1)[None, :]).astype(np.uint32)
    write_dataset(tmp_path / "d", {"train": rows}, {"seq_len": SEQ}, 50)
    return tmp_path / "d" / "train", rows


def all_rows(loader) -> np.ndarray:
    return np.concatenate([b.numpy() for b in loader.iter_sequential(keep_tail=True)])


def cache_file(cache) -> os.PathLike:
    (data,) = cache.glob("*.u32")
    return data


def load(path, cache, **kw):
    messages = []
    loader = ShardLoader(path, seq_len=SEQ, batch_size=10, shuffle=False, cache_dir=cache,
                         on_warning=messages.append, **kw)
    return loader, messages


def test_a_fresh_cache_is_built_with_block_checksums_and_used_silently(tmp_path):
    path, rows = dataset(tmp_path)
    loader, messages = load(path, tmp_path / "c")
    assert loader.memory_mapped and messages == []
    (sums,) = (tmp_path / "c").glob("*.sum")
    assert sums.stat().st_size == -(-rows.nbytes // 256) * 16
    loader.next_batch()  # only the blocks a batch touches are checked
    assert 0 < int(loader._cache.checked.sum()) < loader._cache.num_blocks
    np.testing.assert_array_equal(all_rows(loader), rows)
    assert loader._cache.unchecked == 0
    again, messages = load(path, tmp_path / "c")
    np.testing.assert_array_equal(all_rows(again), rows)
    assert messages == []


@pytest.mark.parametrize("damage", ["zeros", "random"])
def test_a_cache_overwritten_in_place_is_rebuilt_never_trained_on(tmp_path, damage):
    path, rows = dataset(tmp_path)
    load(path, tmp_path / "c")
    data = cache_file(tmp_path / "c")
    size = data.stat().st_size
    junk = bytes(size) if damage == "zeros" else np.random.default_rng(0).bytes(size)
    data.write_bytes(junk)  # same size: the old size check alone took it
    loader, messages = load(path, tmp_path / "c", vocab_size=1000)
    first = loader.next_batch().numpy()  # random bytes used to be an IndexError; zeros were trained on
    np.testing.assert_array_equal(first, rows[:10])
    assert len(messages) == 1 and "do not match the checksum" in messages[0] and str(data) in messages[0]
    np.testing.assert_array_equal(all_rows(loader), rows)
    assert len(messages) == 1  # rebuilt once, then every block checks
    assert data.read_bytes() == rows.astype("<u4").tobytes()


def test_a_block_damaged_deep_in_the_file_is_caught_when_first_read(tmp_path):
    path, rows = dataset(tmp_path)
    loader, messages = load(path, tmp_path / "c")
    loader.next_batch()
    data = cache_file(tmp_path / "c")
    with open(data, "r+b") as f:  # rows 80.. live in a block not read yet
        f.seek(80 * (SEQ + 1) * 4)
        f.write(b"\xff" * 8)
    np.testing.assert_array_equal(all_rows(loader), rows)
    assert len(messages) == 1 and "rebuilding" in messages[0]


def test_a_truncated_cache_or_lost_checksums_are_rebuilt_with_a_warning(tmp_path):
    path, rows = dataset(tmp_path)
    load(path, tmp_path / "c")
    data = cache_file(tmp_path / "c")
    with open(data, "r+b") as f:
        f.truncate(100)
    loader, messages = load(path, tmp_path / "c")
    assert len(messages) == 1 and "truncated" in messages[0]
    np.testing.assert_array_equal(all_rows(loader), rows)
    (sums,) = (tmp_path / "c").glob("*.sum")
    sums.unlink()
    loader, messages = load(path, tmp_path / "c")
    assert len(messages) == 1 and "checksums" in messages[0]
    np.testing.assert_array_equal(all_rows(loader), rows)


def write_plain(path, rows):
    """One uncompressed shard, so that swapping two rows keeps the file's size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"input_ids": pa.array(list(rows), type=pa.list_(pa.uint32()))})
    pq.write_table(table, path, compression="none", use_dictionary=False)


def test_a_same_size_shard_change_with_mtime_restored_is_not_served_from_the_cache(tmp_path):
    _, rows = dataset(tmp_path)
    (tmp_path / "p").mkdir()
    shard = tmp_path / "p" / "shard-00000.parquet"
    write_plain(shard, rows)
    first, _ = load(tmp_path / "p", tmp_path / "c")
    np.testing.assert_array_equal(all_rows(first), rows)
    st = shard.stat()
    swapped = rows[[1, 0] + list(range(2, len(rows)))]
    write_plain(shard, swapped)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second, messages = load(tmp_path / "p", tmp_path / "c")
    np.testing.assert_array_equal(all_rows(second), swapped)
    assert messages == []


def test_without_a_warning_callback_the_rebuild_is_a_python_warning(tmp_path):
    path, rows = dataset(tmp_path)
    ShardLoader(path, seq_len=SEQ, batch_size=10, cache_dir=tmp_path / "c")
    data = cache_file(tmp_path / "c")
    data.write_bytes(bytes(data.stat().st_size))
    loader = ShardLoader(path, seq_len=SEQ, batch_size=10, shuffle=False, cache_dir=tmp_path / "c")
    with pytest.warns(TokenCacheWarning, match="rebuilding"):
        np.testing.assert_array_equal(loader.next_batch().numpy(), rows[:10])
