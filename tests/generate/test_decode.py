"""KV-cache decoding (apr/generate/decode.py) over decoupled bottleneck attention: the cache holds
keys sem_dim + geo_dim wide and decoding with it gives the logits of the full forward."""

from __future__ import annotations

import torch

from apr.config.schema import Architecture
from apr.generate.decode import KVCache, forward_cached, forward_full
from apr.model import spec
from apr.model.llama import build_model


def test_decoding_a_decoupled_model_with_its_narrow_cache_matches_the_full_forward():
    arch = Architecture(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=48, vocab_size=50, max_position_embeddings=16,
                        decoupled_attention={"sem_dim": 2, "geo_dim": 4})
    model = build_model(arch, 3).eval()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model, 2, 10)
    assert cache.k.shape[-1] == 6 and cache.v.shape[-1] == 8
    assert cache.bytes_per_token == spec.kv_cache_bytes_per_token(arch, 4)
    forward_cached(model, ids[:, :6], cache)
    for t in range(6, 10):
        got = forward_cached(model, ids[:, t:t + 1], cache)
        torch.testing.assert_close(got, forward_full(model, ids[:, :t + 1]), rtol=1e-5, atol=1e-5)
