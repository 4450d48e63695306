"""Data shards that are not Parquet files (a FIFO, a folder named *.parquet, an empty, unreadable or
garbage file, a dangling symlink): the plan names each as a C-DATA finding and the loader refuses it
cleanly, fast, never hanging on a FIFO or skipping the entry silently."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.data.loader import ShardLoader
from apr.data.shards import shard_files, write_dataset
from apr.errors import AprError
from apr.plan.build import build_plan
from apr.plan.examples import materialize

SEQ = 7


def _fifo(p):
    os.mkfifo(p)


def _folder(p):
    p.mkdir()


def _empty(p):
    p.write_bytes(b"")


def _garbage(p):
    p.write_bytes(np.random.default_rng(1).bytes(4096))


def _dangling(p):
    p.symlink_to(p.parent / "gone.parquet")


def _unreadable(p):
    p.write_bytes(b"PAR1" + bytes(100) + b"PAR1")
    p.chmod(0)


KINDS = {"fifo": (_fifo, "FIFO"), "folder": (_folder, "directory"), "empty": (_empty, "empty (0 bytes)"),
         "garbage": (_garbage, "Parquet"), "dangling": (_dangling, "symlink"),
         "unreadable": (_unreadable, "")}


@pytest.fixture
def no_root_read(monkeypatch):
    """chmod 000 does not stop root: make the permission check answer as for a normal user."""
    real = os.access

    def access(path, mode, *a, **kw):
        if os.stat(path).st_mode & 0o777 == 0:
            return False
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(os, "access", access)


def _bad(folder, kind):
    make, word = KINDS[kind]
    bad = folder / "shard-00099.parquet"
    make(bad)
    return bad, word


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_loader_refuses_a_shard_that_is_not_a_parquet_file(tmp_path, kind, no_root_read):
    rows = (np.arange(20)[:, None] + np.arange(SEQ + 1)[None, :]).astype(np.uint32)
    write_dataset(tmp_path / "d", {"train": rows}, {"seq_len": SEQ}, 10)
    bad, word = _bad(tmp_path / "d" / "train", kind)
    assert bad in shard_files(tmp_path / "d" / "train")  # listed, not skipped
    start = time.monotonic()
    with pytest.raises(AprError) as info:
        ShardLoader(tmp_path / "d" / "train", seq_len=SEQ, batch_size=2, cache_dir=False)
    assert time.monotonic() - start < 3
    (finding,) = info.value.findings
    assert finding.file == str(bad) and word in finding.message
    if kind == "unreadable":
        assert "permission denied" in finding.message


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_plan_names_the_shard_as_a_data_error(tmp_path, kind, no_root_read):
    cfg, kwargs = materialize({}, tmp_path / "run")
    bad, word = _bad(tmp_path / "run" / "train", kind)
    start = time.monotonic()
    plan = build_plan(cfg, **kwargs)
    assert time.monotonic() - start < 3
    (finding,) = [f for f in plan.errors if f.code == "C-DATA-003"]
    assert str(bad) in finding.message and word in finding.message


def test_plan_cli_exits_1_without_traceback_for_a_fifo_shard(tmp_path):
    cfg, _ = materialize({}, tmp_path / "run")
    bad, _ = _bad(tmp_path / "run" / "train", "fifo")
    start = time.monotonic()
    result = CliRunner().invoke(app, ["train", "plan", str(cfg)])
    assert time.monotonic() - start < 3
    assert result.exit_code == 1, result.output
    out = "".join(result.output.split())  # findings are wrapped to the terminal's width (at hyphens too)
    assert "C-DATA-003" in out and "".join(f"{bad}: is a FIFO (named pipe), not a Parquet file".split()) in out
    assert "Traceback" not in out


def test_a_folder_named_parquet_holding_shards_stands_for_its_shards(tmp_path):
    rows = (np.arange(20)[:, None] + np.arange(SEQ + 1)[None, :]).astype(np.uint32)
    write_dataset(tmp_path / "d", {"train": rows}, {"seq_len": SEQ}, 10)
    spark = tmp_path / "d" / "train" / "part.parquet"
    spark.mkdir()
    os.replace(tmp_path / "d" / "train" / "shard-00001.parquet", spark / "part-0.parquet")
    assert spark not in shard_files(tmp_path / "d" / "train")
    loader = ShardLoader(tmp_path / "d" / "train", seq_len=SEQ, batch_size=2, cache_dir=False)
    assert loader.num_rows == 20


def test_a_fifo_given_as_the_data_path_is_named(tmp_path):
    os.mkfifo(tmp_path / "data.parquet")
    with pytest.raises(AprError) as info:
        ShardLoader(tmp_path / "data.parquet", seq_len=SEQ, batch_size=2, cache_dir=False)
    assert "FIFO" in info.value.findings[0].message
