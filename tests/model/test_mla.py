"""Multi-head latent attention (apr/model/mla.py) against transformers' DeepseekV3 attention built
from the same shapes and weights, and its parameters against the spec the plan counts."""

from __future__ import annotations

import pytest
import torch

from apr.config.schema import Architecture
from apr.model import spec
from apr.model.llama import build_model


def _arch(**mla) -> Architecture:
    return Architecture(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                        vocab_size=101, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500.0,
                        attention={"kind": "mla", "kv_lora_rank": 12, "qk_rope_head_dim": 6, **mla})


def _hf_deepseek(arch: Architecture):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    m = arch.mla
    cfg = DeepseekV3Config(
        hidden_size=arch.hidden_size, num_hidden_layers=arch.num_hidden_layers,
        intermediate_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_attention_heads,
        vocab_size=arch.vocab_size, max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps, kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim, qk_nope_head_dim=arch.head_dim - m.qk_rope_head_dim,
        v_head_dim=arch.head_dim, first_k_dense_replace=arch.num_hidden_layers, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta}, tie_word_embeddings=False,
        attn_implementation="eager")
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("q_lora_rank", [None, 10])
def test_logits_match_transformers_deepseek_v3(q_lora_rank):
    arch = _arch(q_lora_rank=q_lora_rank)
    ours = build_model(arch, seed=3).eval()
    sd = ours.state_dict()
    assert sorted(sd) == sorted(p.name for p in spec.param_specs(arch))  # exactly the spec's names
    assert {k: tuple(v.shape) for k, v in sd.items()} == {p.name: p.shape for p in spec.param_specs(arch)}
    hf = _hf_deepseek(arch)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert (missing, unexpected) == ([], [])
    ids = torch.randint(0, arch.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_latent_attention_is_causal_and_counted_by_the_spec():
    arch = _arch(q_lora_rank=10)
    model = build_model(arch, seed=1).eval()
    assert sum(p.numel() for p in model.parameters()) == spec.param_count(arch)
    ids = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    later = ids.clone()
    later[0, 8:] = (later[0, 8:] + 1) % arch.vocab_size  # the last four tokens changed
    with torch.no_grad():
        a, b = model(ids), model(later)
    assert torch.equal(a[:, :8], b[:, :8]) and not torch.allclose(a[:, 8:], b[:, 8:])
    # h = 64, 4 heads of 16 (10 position-free + 6 RoPE), latent 12, queries through 10
    attention = (10 * 64 + 10 + 64 * 10) + (12 + 6) * 64 + 12 + 4 * (10 + 16) * 12 + 64 * 64
    assert spec.block_numel(arch) == 2 * 64 + attention + 3 * 64 * 96
