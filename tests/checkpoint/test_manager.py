import json
import math

import pytest
import torch

from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState, read_checkpoint, scan
from tests.checkpoint.conftest import make_config, make_tensors


def state(config, step, seed=None, **meta):
    return TrainState(step=step, tensors=make_tensors(config, seed if seed is not None else step),
                      meta={"epoch": 0, "data_cursor": {"epoch": 0, "position": step * 2}, **meta})


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_save_then_load_is_bitwise_and_json_holds_the_record(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    s = state(tiny_config, 5, best_val_loss=math.inf, rng={"python": [1, 2]})
    json_path = mgr.save(s)
    assert json_path == tmp_path / "checkpoint-step-5.json"
    doc = json.loads(json_path.read_text())
    assert doc["format"] == "apr-checkpoint" and doc["format_version"] == 1
    assert doc["step"] == 5 and doc["is_best"] is False and doc["epoch"] == 0
    assert doc["weights_file"] == "checkpoint-step-5.safetensors"
    assert doc["weights_size"] == (tmp_path / "checkpoint-step-5.safetensors").stat().st_size
    assert len(doc["weights_sha256"]) == 64
    assert doc["config"]["model"]["architecture"]["hidden_size"] == 16
    assert doc["config_hash"] == mgr.config_hash and doc["apr_version"]

    loaded, path = CheckpointManager(tmp_path, tiny_config).load("latest")
    assert path == json_path
    assert loaded.step == 5
    assert loaded.meta == s.meta  # inf survives
    assert set(loaded.tensors) == set(s.tensors)
    for k, t in s.tensors.items():
        assert torch.equal(loaded.tensors[k], t), k
    assert loaded.info.config == doc["config"]


def test_keep_last_prunes_older_and_best_survives(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config, keep_last=2)
    mgr.save(state(tiny_config, 10), is_best=True)
    mgr.save(state(tiny_config, 20))
    mgr.save(state(tiny_config, 30))
    assert names(tmp_path) == ["checkpoint-best.json", "checkpoint-best.safetensors",
                               "checkpoint-step-20.json", "checkpoint-step-20.safetensors",
                               "checkpoint-step-30.json", "checkpoint-step-30.safetensors"]
    best = read_checkpoint(tmp_path / "checkpoint-best.json", tiny_config)
    assert best.step == 10 and best.info.is_best
    assert torch.equal(best.tensors["lm_head.weight"], make_tensors(tiny_config, 10)["lm_head.weight"])
    mgr.save(state(tiny_config, 40), is_best=True)
    assert read_checkpoint(tmp_path / "checkpoint-best.json").step == 40
    assert [e.step for e in scan(tmp_path)] == [40, 30]


def test_disk_use_stays_constant_over_a_long_run(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)  # keep_last 1
    used = []
    for step in range(1, 13):
        mgr.save(state(tiny_config, step), is_best=step % 3 == 0)
        inodes = {p.stat().st_ino: p.stat().st_size for p in tmp_path.iterdir()}  # best is a hard link
        used.append(sum(inodes.values()))
        assert len(list(tmp_path.iterdir())) == 4 if step >= 3 else True
    one_pair = sum(p.stat().st_size for p in tmp_path.glob("checkpoint-step-*"))
    # at most two pairs (the latest and the best, which shares the latest's bytes when it is the latest)
    assert max(used) <= 2 * one_pair + 64


def test_pruning_clears_interrupted_saves_and_abandoned_later_steps(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(state(tiny_config, 30))
    (tmp_path / "checkpoint-step-40.safetensors").write_bytes(b"half a file")  # crash before its JSON
    (tmp_path / ".checkpoint-step-50.safetensors.abc.tmp").write_bytes(b"x")
    mgr.save(state(tiny_config, 20))  # a run resumed from an earlier checkpoint
    assert names(tmp_path) == ["checkpoint-step-20.json", "checkpoint-step-20.safetensors"]


def test_missing_json_is_ignored_and_said(tmp_path, tiny_config):
    warnings = []
    mgr = CheckpointManager(tmp_path, tiny_config, on_warning=warnings.append)
    mgr.save(state(tiny_config, 3))
    mgr.keep_last = 5
    mgr.save(state(tiny_config, 6))
    (tmp_path / "checkpoint-step-6.json").unlink()
    s, path = mgr.load("latest")
    assert s.step == 3 and path.name == "checkpoint-step-3.json"
    assert any("checkpoint-step-6.safetensors has no JSON" in w for w in warnings)


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "truncated"),
    ("flip", "sha_mismatch"),
    ("swap", "sha_mismatch"),
])
def test_damaged_latest_falls_back_and_says_so(tmp_path, tiny_config, damage, reason):
    mgr = CheckpointManager(tmp_path, tiny_config, keep_last=3)
    mgr.save(state(tiny_config, 10))
    mgr.save(state(tiny_config, 20))
    w = tmp_path / "checkpoint-step-20.safetensors"
    data = bytearray(w.read_bytes())
    if damage == "truncate":
        w.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) - 100] ^= 0x01
        w.write_bytes(bytes(data))
    else:  # the weights of another step under this name, same size
        w.write_bytes((tmp_path / "checkpoint-step-10.safetensors").read_bytes())

    with pytest.raises(CheckpointError) as err:
        mgr.load(tmp_path / "checkpoint-step-20.json")  # named explicitly: refused, no fallback
    assert err.value.reason == reason
    assert err.value.findings[0].file.endswith("checkpoint-step-20.safetensors")

    s, path = mgr.load("latest")
    assert s.step == 10 and path.name == "checkpoint-step-10.json"
    assert torch.equal(s.tensors["model.norm.weight"], make_tensors(tiny_config, 10)["model.norm.weight"])
    assert any("checkpoint-step-20" in w and "older" in w for w in mgr.warnings)
    assert any("resuming from checkpoint-step-10.json" in w for w in mgr.warnings)


def _rewrite_json(path, **changes):
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_foreign_weights_are_refused(tmp_path, tiny_config):
    """Weights of another model with a JSON whose SHA matches them: caught by the shape check."""
    other = make_config(**{"model.architecture.hidden_size": 32})
    other_dir = tmp_path / "other"
    CheckpointManager(other_dir, other).save(state(other, 10))
    run = tmp_path / "run"
    CheckpointManager(run, tiny_config).save(state(tiny_config, 5))
    mgr = CheckpointManager(run, tiny_config, keep_last=3)
    mgr.save(state(tiny_config, 10))
    foreign = (other_dir / "checkpoint-step-10.safetensors").read_bytes()
    (run / "checkpoint-step-10.safetensors").write_bytes(foreign)
    from apr.checkpoint.files import sha256_file

    sha, size = sha256_file(run / "checkpoint-step-10.safetensors")
    _rewrite_json(run / "checkpoint-step-10.json", weights_sha256=sha, weights_size=size)
    with pytest.raises(CheckpointError, match="foreign") as err:
        read_checkpoint(run / "checkpoint-step-10.json")
    assert err.value.reason == "foreign"
    assert "hidden" not in err.value.message and "model.embed_tokens.weight has shape [40, 32]" in err.value.message
    s, _ = mgr.load("latest")
    assert s.step == 5


def test_checkpoint_of_another_model_is_refused_without_fallback(tmp_path, tiny_config):
    CheckpointManager(tmp_path, tiny_config).save(state(tiny_config, 5))
    bigger = make_config(**{"model.architecture.num_hidden_layers": 3})
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(tmp_path, bigger).load("latest")
    assert err.value.reason == "model_mismatch"
    assert any("model.layers.2" in f.message for f in err.value.findings)


@pytest.mark.parametrize("edit, reason", [
    ({"format": "something-else"}, "not_apr"),
    ({"format_version": 99}, "unsupported_version"),
    ({"step": 6}, "foreign"),
    ({"weights_file": "../elsewhere.safetensors"}, "bad_meta"),
    ({"loss_tensors": {"optimizer.loss.distill.down": [4, 8]}}, "foreign"),  # listed, not in the file
    ({"loss_tensors": {"model.norm.weight": [4]}}, "not_apr"),  # a model weight is no loss tensor
])
def test_json_that_is_not_ours_is_refused(tmp_path, tiny_config, edit, reason):
    CheckpointManager(tmp_path, tiny_config).save(state(tiny_config, 5))
    _rewrite_json(tmp_path / "checkpoint-step-5.json", **edit)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(tmp_path / "checkpoint-step-5.json")
    assert err.value.reason == reason


def test_garbage_json_and_nothing_usable(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        mgr.load("latest")
    mgr.save(state(tiny_config, 5))
    (tmp_path / "checkpoint-step-5.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as err:
        mgr.load("latest")
    assert err.value.findings[0].code == "checkpoint.unreadable"


def test_best_is_the_last_resort(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(state(tiny_config, 5), is_best=True)
    mgr.save(state(tiny_config, 8))
    (tmp_path / "checkpoint-step-8.safetensors").write_bytes(b"\0" * 10)
    s, path = mgr.load("latest")
    assert s.step == 5 and path.name == "checkpoint-best.json"
    assert any("checkpoint-best.json" in w for w in mgr.warnings)


def test_load_by_weights_path_or_run_dir(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path / "run", tiny_config)
    mgr.save(state(tiny_config, 7))
    s, p = mgr.load(tmp_path / "run" / "checkpoint-step-7.safetensors")
    assert s.step == 7 and p.suffix == ".json"
    s, _ = mgr.load(tmp_path / "run")
    assert s.step == 7


def test_rewriting_a_step_replaces_it_cleanly(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(state(tiny_config, 5, seed=1))
    mgr.save(state(tiny_config, 5, seed=2))
    s, _ = mgr.load("latest")
    assert torch.equal(s.tensors["lm_head.weight"], make_tensors(tiny_config, 2)["lm_head.weight"])


def test_save_checks_the_state_against_the_model(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    bad = state(tiny_config, 1)
    del bad.tensors["optimizer.v.lm_head.weight"]
    with pytest.raises(ValueError, match="optimizer.v.lm_head.weight"):
        mgr.save(bad)
    half = state(tiny_config, 1)
    half.tensors["model.norm.weight"] = half.tensors["model.norm.weight"].half()
    with pytest.raises(ValueError, match="float32"):
        mgr.save(half)
    with pytest.raises(ValueError, match="reserved"):
        mgr.save(state(tiny_config, 1, weights_sha256="x"))
    assert list(tmp_path.iterdir()) == []


def test_tied_embeddings_have_no_lm_head(tmp_path):
    cfg = make_config(**{"model.architecture.tie_word_embeddings": True})
    tensors = make_tensors(cfg)
    assert "lm_head.weight" not in tensors
    mgr = CheckpointManager(tmp_path, cfg)
    mgr.save(TrainState(3, tensors, {}))
    s, _ = mgr.load("latest")
    assert set(s.tensors) == set(tensors)


def test_hostile_checkpoint_files_are_checkpoint_errors_not_hangs_or_tracebacks(tmp_path):
    import os

    from apr.checkpoint.manager import read_info

    fifo = tmp_path / "checkpoint-step-1.json"
    os.mkfifo(fifo)  # reading it would block forever
    deep = tmp_path / "checkpoint-step-2.json"
    deep.write_text('{"format": "apr-checkpoint", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    huge = tmp_path / "checkpoint-step-3.json"
    with open(huge, "wb") as f:
        f.truncate(2**31)
    loop = tmp_path / "checkpoint-step-4.json"
    loop.symlink_to(loop)
    for path, needle in ((fifo, "FIFO"), (deep, "levels deep"), (huge, "2 GiB"), (loop, "symlink loop")):
        with pytest.raises(CheckpointError) as e:
            read_info(path)
        assert needle in e.value.message and e.value.findings[0].code == "checkpoint.unreadable"
    with pytest.raises(CheckpointError) as e:
        read_info(tmp_path / "checkpoint-step-5.json")
    assert e.value.findings[0].code == "checkpoint.missing"


def _same_digest(json_path, weights):
    import hashlib

    data = weights.read_bytes()
    _rewrite_json(json_path, weights_sha256=hashlib.sha256(data).hexdigest(), weights_size=len(data))


@pytest.mark.parametrize("edit", ["other_steps_weights", "names_other_weights", "optimizer_steps"])
def test_a_json_that_disagrees_with_itself_is_refused_and_latest_falls_back(tmp_path, tiny_config, edit):
    """Intact files with valid digests that do not describe one checkpoint: never resumed silently."""
    from tests.checkpoint.test_sidecar import trainer_meta

    mgr = CheckpointManager(tmp_path, tiny_config, keep_last=3, trainer_state=True)
    for step in (10, 20):
        mgr.save(TrainState(step=step, tensors=make_tensors(tiny_config, step), meta=trainer_meta(step)))
    j20, w20, w10 = (tmp_path / n for n in ("checkpoint-step-20.json", "checkpoint-step-20.safetensors",
                                            "checkpoint-step-10.safetensors"))
    if edit == "other_steps_weights":  # step 10's weights under step 20's name, the JSON's digest updated
        w20.write_bytes(w10.read_bytes())
        _same_digest(j20, w20)
    elif edit == "names_other_weights":
        _rewrite_json(j20, weights_file=w10.name)
        _same_digest(j20, w10)
    else:
        doc = json.loads(j20.read_text())
        doc["engine"]["optimizer_steps"] = 5000
        j20.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as err:
        mgr.load(j20)
    assert err.value.reason == "edited"
    assert any(said in err.value.message for said in ("weights of step 10", "names the weights checkpoint-step-10",
                                                      "5000 optimizer updates at step 20"))
    s, path = mgr.load("latest")
    assert s.step == 10 and path.name == "checkpoint-step-10.json"
    assert any("checkpoint-step-20" in w and "older" in w for w in mgr.warnings)


def test_pruning_an_interrupted_save_says_so(tmp_path, tiny_config):
    warnings = []
    mgr = CheckpointManager(tmp_path, tiny_config, on_warning=warnings.append)
    mgr.save(state(tiny_config, 10))
    (tmp_path / "checkpoint-step-10.json").unlink()  # killed before its JSON
    mgr.save(state(tiny_config, 20))
    assert names(tmp_path) == ["checkpoint-step-20.json", "checkpoint-step-20.safetensors"]
    assert any("removed checkpoint-step-10.safetensors" in w and "interrupted save" in w for w in warnings)
    assert not any("checkpoint-step-20" in w for w in warnings)


def test_resume_latest_with_only_an_interrupted_save_says_how_to_go_on(tmp_path, tiny_config):
    mgr = CheckpointManager(tmp_path, tiny_config)
    mgr.save(state(tiny_config, 10))
    (tmp_path / "checkpoint-step-10.json").unlink()
    with pytest.raises(CheckpointError) as err:
        mgr.load("latest")
    assert "interrupted save" in err.value.message and "without --resume" in err.value.message
    assert (tmp_path / "checkpoint-step-10.safetensors").exists()
