"""KV-cache decoding (apr/generate/decode.py) over decoupled bottleneck attention (the cache holds
keys sem_dim + geo_dim wide) and multi-head latent attention (the cache holds each token's latent
and RoPE key): decoding with either gives the logits of the full forward."""

from __future__ import annotations

import pytest
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


def _latent_model(moe=None):
    arch = Architecture(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                        vocab_size=50, max_position_embeddings=16, moe=moe,
                        attention={"kind": "mla", "kv_lora_rank": 6, "qk_rope_head_dim": 4, "q_lora_rank": 8})
    return arch, build_model(arch, 3).eval()


@pytest.mark.parametrize("moe", [None, {"num_experts": 4, "top_k": 2}], ids=["dense", "experts"])
def test_a_latent_attention_model_caches_its_latent_and_rope_key_and_decodes_as_the_full_forward(moe):
    arch, model = _latent_model(moe)
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model, 2, 10)
    assert cache.k is None and cache.v is None  # no per-head keys or values
    assert cache.latent.shape == (2, 2, 10, 6) and cache.rope_key.shape == (2, 2, 1, 10, 4)
    assert cache.bytes_per_token == spec.kv_cache_bytes_per_token(arch, 4) == 2 * (6 + 4) * 4
    forward_cached(model, ids[:, :6], cache)
    for t in range(6, 10):
        got = forward_cached(model, ids[:, t:t + 1], cache)
        torch.testing.assert_close(got, forward_full(model, ids[:, :t + 1]), rtol=1e-5, atol=1e-5)


def test_left_padded_rows_of_a_latent_attention_model_decode_as_each_row_alone():
    _, model = _latent_model()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    padded = ids.clone()
    padded[1, :3] = padded[1, 3]  # row 1 is a 6-token prompt, left-padded by 3
    cache = KVCache(model, 2, 9)
    pad = torch.tensor([0, 3])
    first = forward_cached(model, padded[:, :7], cache, pad)
    torch.testing.assert_close(first[1], forward_full(model, ids[1:, 3:7])[0], rtol=1e-5, atol=1e-5)
    for t in range(7, 9):
        got = forward_cached(model, padded[:, t:t + 1], cache, pad)
        torch.testing.assert_close(got[0], forward_full(model, ids[:1, :t + 1])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], forward_full(model, ids[1:, 3:t + 1])[0], rtol=1e-5, atol=1e-5)
