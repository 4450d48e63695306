"""The trunk-activation cache (apr/train/trunk_cache.py): a row read back is the row computed, a
row whose file no longer matches its checksum is refused with the file's name, and the folder is
keyed by the trunk's weights (other weights never read a cache)."""

from __future__ import annotations

import pytest
import torch

from apr.errors import AprError
from apr.model.llama import build_model
from apr.train.trunk_cache import TrunkCache, trunk_digest
from tests.train.tiny import make_config


def _cache(tmp_path, model, digest="d" * 32):
    return TrunkCache(tmp_path, 2, digest=lambda: digest, warn=lambda message: None)


def test_a_cached_row_gives_what_the_trunk_computes_and_a_corrupt_one_is_refused(tmp_path):
    arch = make_config(model={"architecture": {"num_hidden_layers": 3}}).model.architecture
    model = build_model(arch, 3, device="cpu")
    ids = torch.randint(0, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.hidden_states(ids, torch.float32)
        first = _cache(tmp_path, model).hidden(model, ids, torch.float32)
        again = _cache(tmp_path, model)  # a new run over the same folder
        got = again.hidden(model, ids, torch.float32)
    assert first.equal(want) and got.equal(want) and again.hits == 1 and again.misses == 0
    path = next(iter(again.files.values()))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte of the stored activations
    path.write_bytes(bytes(data))
    with pytest.raises(AprError, match=path.name):
        _cache(tmp_path, model).hidden(model, ids, torch.float32)


def test_the_cache_folder_is_keyed_by_the_trunk_weights():
    w = {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4)}
    changed = {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4).index_fill_(0, torch.tensor([2]), 1.5)}
    assert trunk_digest(w, 16, torch.float32) == trunk_digest({k: v.clone() for k, v in w.items()}, 16, torch.float32)
    assert trunk_digest(w, 16, torch.float32) != trunk_digest(changed, 16, torch.float32)
    assert trunk_digest(w, 16, torch.float32) != trunk_digest(w, 32, torch.float32)


def test_the_cache_runs_through_a_trunk_stored_in_nf4_and_gives_the_uncached_weights(tmp_path):
    """StackWise's activation cache through a 4-bit (QLoRA's NF4) trunk: a frozen trunk stored in NF4
    without adapters computes the same output for a row every time, so its rows are cached and the run
    ends bitwise where the uncached one does. (Trunk adapters train, so with them the cache is
    refused at validate: tests/plan/test_validate.py.)"""
    pytest.importorskip("torchao")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_helpers import config_doc, make_dataset

    from apr.checkpoint.manager import read_checkpoint
    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.plan.build import resolve_config
    from apr.train.options import ApplyOptions
    from apr.train.run import prepare_run

    arch = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # projections that split into NF4's 64-weight blocks
    final = {}
    for cache in (False, True):
        root = tmp_path / str(cache)
        make_dataset(root, train_rows=20)  # 5 steps an epoch: stage 1 reads rows again
        stacking = {"stages": [{"blocks": 2, "steps": 1, "precision": "nf4"}, {"blocks": 4}], "earlier": "freeze",
                    "freeze_embedding": True, "cache_activations": cache}
        cfg = AprConfig.model_validate(config_doc(root, model={"architecture": arch, "stacking": stacking},
                                                  training={"max_steps": 9, "save_interval": 9, "eval_interval": 0}))
        run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                          options=ApplyOptions(echo=lambda line: None, handle_signals=False))
        assert run.execute().status == "finished"
        if cache:
            assert run.engine.trunk_cache.hits > 0 and run.engine.trunk_cache.misses > 0
        final[cache] = read_checkpoint(next((root / "run").glob("checkpoint-step-9.json"))).tensors
    assert set(final[True]) == set(final[False])
    assert all(final[True][k].equal(final[False][k]) for k in final[False])
