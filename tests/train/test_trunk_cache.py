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
