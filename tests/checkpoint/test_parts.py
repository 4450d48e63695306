"""Sharded checkpoints: one safetensors part per rank, the JSON (written last) names each part's
digest. Every rank's save runs in its own thread with its own manager, as on K processes; the
exchange of digests is a thread barrier standing in for the all-gather."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from apr.checkpoint.export import export_hf
from apr.checkpoint.files import write_safetensors
from apr.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    TrainState,
    load_latest,
    read_checkpoint,
    scan,
)
from apr.checkpoint.parts import LazyTensors, index_digest, write_part
from apr.config.loader import config_doc_hash
from tests.checkpoint.conftest import make_config
from tests.checkpoint.test_export import ARCH, tokenizer_file, weights  # noqa: F401


class Ranks:
    """K ranks' exchange of (sha, size): every rank gets every rank's, in rank order."""

    def __init__(self, world: int):
        self.world = world
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def exchange(self, rank: int):
        def ex(sha: str, size: int):
            self.slots[rank] = (sha, size)
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return ex


def rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """FSDP2's split: ceil(rows / world) rows per rank, in rank order (the last ones may hold fewer or none)."""
    chunk = -(-t.shape[0] // world)
    return t[rank * chunk:(rank + 1) * chunk]


def save_sharded(folder, config, tensors: dict, step: int, world: int, is_best: bool = False,
                 fail_rank: int | None = None) -> list:
    """Every rank saves its rows of ``tensors`` in parallel; returns each rank's result or exception."""
    ranks, results = Ranks(world), [None] * world

    def run(rank: int) -> None:
        manager = CheckpointManager(folder, config, keep_last=2)
        part = {n: rows(t, rank, world).clone() for n, t in tensors.items()}
        ex = ranks.exchange(rank)
        try:
            if rank == fail_rank:  # its part cannot be written (the folder is not writable for it)
                def broken(*args, **kwargs):
                    raise OSError("disk gone")

                manager._check_free_space = broken
            results[rank] = manager.save_part(TrainState(step, part, {"epoch": 0}), rank, world, ex, is_best=is_best)
        except Exception as err:  # noqa: BLE001 - the test looks at it
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.fixture
def config(tokenizer_file):  # noqa: F811
    return make_config(**ARCH, **{"data.tokenizer": str(tokenizer_file)})


def test_each_rank_writes_its_part_and_readers_get_the_whole_tensors(tmp_path, config):
    tensors = weights(config)
    results = save_sharded(tmp_path / "run", config, tensors, 4, world=3, is_best=True)
    json_path = tmp_path / "run" / "checkpoint-step-4.json"
    assert results == [json_path] * 3
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert [n for n in names if n.startswith("checkpoint-step-4.")] == [
        "checkpoint-step-4.json", *(f"checkpoint-step-4.part-{r}-of-3.safetensors" for r in range(3))]
    assert "checkpoint-step-4.safetensors" not in names  # nothing gathered into one file
    doc = json.loads(json_path.read_text())
    assert doc["format_version"] == 2 and len(doc["weights_parts"]) == 3
    part1 = load_file(str(tmp_path / "run" / "checkpoint-step-4.part-1-of-3.safetensors"))
    assert all(torch.equal(part1[n], rows(t, 1, 3)) for n, t in tensors.items())  # only its rows
    for which in (json_path, tmp_path / "run" / "checkpoint-best.json", tmp_path / "run"):
        state = read_checkpoint(which) if which.suffix == ".json" else load_latest(which)
        assert state.step == 4 and set(state.tensors) == set(tensors)
        assert all(torch.equal(state.tensors[n], t) for n, t in tensors.items())
    assert read_checkpoint(tmp_path / "run" / "checkpoint-step-4.part-2-of-3.safetensors").step == 4


def test_hf_export_of_a_sharded_checkpoint_is_the_export_of_the_whole_one(tmp_path, config):
    tensors = weights(config)
    save_sharded(tmp_path / "parts", config, tensors, 4, world=2)
    CheckpointManager(tmp_path / "whole", config).save(TrainState(4, tensors, {"epoch": 0}))
    export_hf(tmp_path / "parts" / "checkpoint-step-4.json", tmp_path / "hf-parts")
    export_hf(tmp_path / "whole" / "checkpoint-step-4.json", tmp_path / "hf-whole")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf-parts", "hf-whole"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_a_torn_or_damaged_sharded_save_never_looks_complete(tmp_path, config):
    run = tmp_path / "run"
    first = weights(config, seed=1)
    save_sharded(run, config, first, 2, world=2)
    # a rank that cannot write: no JSON for step 4, its partner's part is ignored, step 2 is loaded
    results = save_sharded(run, config, weights(config, seed=2), 4, world=2, fail_rank=1)
    assert isinstance(results[0], CheckpointError) and isinstance(results[1], OSError)
    assert not (run / "checkpoint-step-4.json").exists()
    warnings: list[str] = []
    state = load_latest(run, warn=warnings.append)
    assert state.step == 2 and all(torch.equal(state.tensors[n], t) for n, t in first.items())
    # a complete save whose part is then damaged: SHA-256 mismatch, the previous one is loaded
    save_sharded(run, config, weights(config, seed=3), 6, world=2)
    part = run / "checkpoint-step-6.part-1-of-2.safetensors"
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(run / "checkpoint-step-6.json")
    assert err.value.reason == "sha_mismatch" and "part-1-of-2" in err.value.message
    warnings.clear()
    assert load_latest(run, warn=warnings.append).step == 2
    assert any("checkpoint-step-6.part-1-of-2.safetensors is corrupt" in w for w in warnings)
    part.unlink()  # a missing part
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(run / "checkpoint-step-6.json")
    assert err.value.reason == "missing_weights"


def test_pruning_and_rewriting_remove_old_parts(tmp_path, config):
    run = tmp_path / "run"
    for step in (2, 4, 6):  # keep_last 2: step 2's JSON and parts go
        save_sharded(run, config, weights(config, seed=step), step, world=2)
    assert [e.step for e in scan(run)] == [6, 4]
    assert not any(p.name.startswith("checkpoint-step-2.") for p in run.iterdir())
    # step 6 written again on 3 ranks (a resume on another number of ranks): the 2-rank parts go
    save_sharded(run, config, weights(config, seed=7), 6, world=3)
    six = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-step-6."))
    assert six == ["checkpoint-step-6.json", *(f"checkpoint-step-6.part-{r}-of-3.safetensors" for r in range(3))]
    # and once more by one process: one file, no parts
    CheckpointManager(run, config, keep_last=2).save(TrainState(6, weights(config, seed=8), {"epoch": 0}))
    six = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-step-6."))
    assert six == ["checkpoint-step-6.json", "checkpoint-step-6.safetensors"]
    assert torch.equal(read_checkpoint(run / "checkpoint-step-6.json").tensors["model.norm.weight"],
                       weights(config, seed=8)["model.norm.weight"])


def test_an_edited_parts_list_is_refused(tmp_path, config):
    save_sharded(tmp_path / "run", config, weights(config), 4, world=2)
    path = tmp_path / "run" / "checkpoint-step-4.json"
    doc = json.loads(path.read_text())
    doc["weights_parts"] = doc["weights_parts"][:1]  # one part dropped
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert err.value.reason == "edited"
    doc["weights_parts"] = [{"file": "../elsewhere.safetensors", "sha256": "0" * 64, "size": 1}]
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert err.value.reason == "bad_meta"


def test_a_rank_reads_only_its_rows_across_any_parts(tmp_path, config):
    """LazyTensors.rows: rows start:stop of the whole tensor from 3 parts (the last one holding no
    rows of a 2-row tensor split 3 ways), and from a single file, as a 4-rank or 2-rank resume asks."""
    tensors = weights(config)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:2].clone()  # fewer rows than parts
    paths = []
    for r in range(3):  # the parts, written directly (any tensors will do here)
        path = tmp_path / f"checkpoint-step-4.part-{r}-of-3.safetensors"
        write_part(path, {n: rows(t, r, 3) for n, t in tensors.items()}, 4, r, 3)
        paths.append(path)
    lazy = LazyTensors(paths)
    assert lazy.shapes == {n: tuple(t.shape) for n, t in tensors.items()} and set(lazy) == set(tensors)
    for name, whole in tensors.items():
        n = whole.shape[0]
        for ranks in (1, 2, 4, 5):
            chunk = -(-n // ranks)
            for r in range(ranks):
                start, stop = min(r * chunk, n), min((r + 1) * chunk, n)
                assert torch.equal(lazy.rows(name, start, stop), whole[start:stop]), (name, ranks, r)
        assert torch.equal(lazy[name], whole)
    single = tmp_path / "whole.safetensors"
    write_safetensors(single, tensors)
    one = LazyTensors([single])
    assert torch.equal(one.rows("model.embed_tokens.weight", 3, 9), tensors["model.embed_tokens.weight"][3:9])


def test_parts_that_do_not_make_one_checkpoint_are_refused_even_with_matching_digests(tmp_path, config):
    """Part 1 rewritten without one tensor, its new digest and size put in the JSON (so the files
    verify): the parts no longer assemble into the model, so the checkpoint is refused as damaged
    and a resume falls back to the previous one."""
    run = tmp_path / "run"
    save_sharded(run, config, weights(config, seed=1), 2, world=2)
    tensors = weights(config, seed=2)
    save_sharded(run, config, tensors, 4, world=2)
    part = run / "checkpoint-step-4.part-1-of-2.safetensors"
    sha, size = write_part(part, {n: rows(t, 1, 2) for n, t in tensors.items() if n != "model.norm.weight"}, 4, 1, 2)
    path = run / "checkpoint-step-4.json"
    doc = json.loads(path.read_text())
    doc["weights_parts"][1].update(sha256=sha, size=size)
    doc["weights_sha256"] = index_digest([e["sha256"] for e in doc["weights_parts"]])
    assert doc["config_hash"] == config_doc_hash(doc["config"])
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert err.value.reason == "bad_weights" and "part-1-of-2" in err.value.message
    warnings: list[str] = []
    assert load_latest(run, warn=warnings.append).step == 2 and warnings


def test_ranks_verify_a_checkpoint_together_hashing_each_file_once(tmp_path, config, monkeypatch):
    """2 ranks resume from 3 parts: each hashes its share (parts 0 and 2, part 1), every file is
    hashed once in all; a corrupt part found by one rank makes both fall back to the same older
    checkpoint (the agreement stands in for the all-reduce)."""
    from apr.checkpoint import files
    from apr.checkpoint.manager import VerifyShare

    run = tmp_path / "run"
    save_sharded(run, config, weights(config, seed=1), 2, world=3)
    save_sharded(run, config, weights(config, seed=2), 4, world=3)
    hashed: list[tuple[int, str]] = []
    real_sha = files.sha256_file
    local = threading.local()

    def counting(path, *args, **kwargs):
        hashed.append((local.rank, path.name))
        return real_sha(path, *args, **kwargs)

    monkeypatch.setattr(files, "sha256_file", counting)
    barrier, votes = threading.Barrier(2, timeout=30), [True, True]

    def agree(rank: int):
        def all_true(ok: bool) -> bool:
            votes[rank] = ok
            barrier.wait()
            out = all(votes)
            barrier.wait()
            return out
        return all_true

    def resume_on_two_ranks() -> list:
        got: list = [None, None]

        def rank_main(rank: int) -> None:
            local.rank = rank
            warnings: list[str] = []
            state = load_latest(run, config, warnings.append, lazy=True, share=VerifyShare(rank, 2, agree(rank)))
            got[rank] = (state.step, warnings)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return got

    got = resume_on_two_ranks()
    assert [g[0] for g in got] == [4, 4]
    assert sorted(hashed) == [(0, "checkpoint-step-4.part-0-of-3.safetensors"),
                              (0, "checkpoint-step-4.part-2-of-3.safetensors"),
                              (1, "checkpoint-step-4.part-1-of-3.safetensors")]
    part = run / "checkpoint-step-4.part-2-of-3.safetensors"  # rank 0's to hash
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))
    hashed.clear()
    got = resume_on_two_ranks()
    assert [g[0] for g in got] == [2, 2]  # both fell back, to the same checkpoint
    assert any("part-2-of-3.safetensors is corrupt" in w for w in got[0][1])
    assert any("another rank found one of its files corrupt" in w for w in got[1][1])
    assert len([h for h in hashed if "step-2." in h[1]]) == 3  # step 2's parts, once each
