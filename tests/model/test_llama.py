"""The model against Hugging Face's LlamaForCausalLM built from the same shapes and weights."""

from __future__ import annotations

import pytest
import torch

from apr.config.schema import Architecture
from apr.model import spec
from apr.model.llama import build_model


def _arch(**kw) -> Architecture:
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=101, max_position_embeddings=32, rms_norm_eps=1e-5,
                rope_theta=500.0)
    base.update(kw)
    return Architecture(**base)


def _hf_model(arch: Architecture):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=arch.hidden_size, num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.kv_heads,
        intermediate_size=arch.intermediate_size, vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta, tie_word_embeddings=arch.tie_word_embeddings,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied):
    arch = _arch(tie_word_embeddings=tied)
    ours = build_model(arch, seed=3)
    hf = _hf_model(arch)
    ours_sd = ours.state_dict()
    names = [p.name for p in spec.param_specs(arch)]
    assert sorted(ours_sd) == sorted(names)  # exactly the spec's HF names, no extras
    missing, unexpected = hf.load_state_dict(ours_sd, strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if tied else [])  # HF ties it to the embedding itself
    ids = torch.randint(0, arch.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.shape == (3, 17, arch.vocab_size)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_chunked_loss_equals_full_cross_entropy():
    arch = _arch()
    model = build_model(arch, seed=1)
    ids = torch.randint(0, arch.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(ids, -1, dims=1)
    full = torch.nn.functional.cross_entropy(model(ids).reshape(-1, arch.vocab_size), targets.reshape(-1))
    for chunk in (1, 5, 21, 64):
        assert torch.allclose(model(ids, targets, loss_chunk_size=chunk), full, rtol=1e-6)


def test_init_is_deterministic_from_seed():
    arch = _arch()
    a, b, c = build_model(arch, 7), build_model(arch, 7), build_model(arch, 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - arch.initializer_range) < 0.2 * arch.initializer_range
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name



def test_attention_heads_take_the_architectures_head_dim():
    arch = _arch()
    attn = build_model(arch, seed=0).model.layers[0].self_attn
    assert attn.head_dim == arch.head_dim == 16
    assert attn.q_proj.weight.shape == (arch.num_attention_heads * 16, arch.hidden_size)
    assert attn.k_proj.weight.shape == (arch.kv_heads * 16, arch.hidden_size)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.5,
     "beta_fast": 16.0, "truncate": False},
])
def test_rope_scaling_gives_transformers_frequencies_bit_for_bit(scaling):
    """Each scaling's inverse frequencies and cos/sin factor, inside max_position_embeddings and past
    it (dynamic grows its base there), equal transformers' own functions exactly."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from apr.model.llama import rope_frequencies

    arch = _arch(rope_scaling=scaling)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                      rope_parameters={"rope_theta": 500.0, **scaling})
    plain, _ = rope_frequencies(_arch(), 32, "cpu")
    for seq_len in (16, 32, 80):
        theirs, their_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq_len=seq_len)
        ours, our_scale = rope_frequencies(arch, seq_len, "cpu")
        assert torch.equal(ours, theirs) and our_scale == their_scale, seq_len
    assert not torch.equal(ours, plain)  # the scaling changed something (dynamic: past 32 positions)


def test_qwen2_biases_start_at_zero_and_a_sliding_window_masks_older_keys():
    arch = _arch(family="qwen2")
    model = build_model(arch, seed=0)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and not attn.q_proj.bias.any() and attn.o_proj.bias is None
    assert {n for n, _ in model.named_parameters()} == {p.name for p in spec.param_specs(arch)}
    window = build_model(_arch(family="mistral", sliding_window=4), seed=0)
    full = build_model(_arch(family="mistral"), seed=0)
    ids = torch.randint(0, 101, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = window(ids), full(ids)
    assert torch.equal(a[:, :4], b[:, :4])  # within the window nothing changes
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("decoupled", [None, {"sem_dim": 8, "geo_dim": 4}])
def test_dropout_acts_in_training_mode_only(decoupled):
    """model.architecture.dropout: in training mode two forwards draw different masks; in eval mode
    the model is the same function as without dropout, bit for bit."""
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with_dropout = build_model(_arch(dropout=0.3, decoupled_attention=decoupled), seed=5)
    without = build_model(_arch(decoupled_attention=decoupled), seed=5)
    assert not torch.equal(with_dropout(ids), with_dropout(ids))
    torch.manual_seed(7)
    first = with_dropout(ids)
    torch.manual_seed(7)
    assert torch.equal(with_dropout(ids), first)  # the masks come from the global RNG
    with_dropout.eval()
    assert torch.equal(with_dropout(ids), without.eval()(ids))
