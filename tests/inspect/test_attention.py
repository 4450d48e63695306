"""Attention maps are the weights the layer used: causal rows summing to 1 that, applied to the
values, give what SDPA gave."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from apr.generate.load import load_for_inference  # noqa: E402
from apr.inspect.attention import AttentionInputError, attention_maps  # noqa: E402


@pytest.fixture(scope="module")
def loaded(untrained_lm):
    return load_for_inference(untrained_lm.checkpoint)


def test_maps_are_causal_distributions_that_reproduce_the_layer(loaded):
    prompt = "def encode(self, o):"
    maps = attention_maps(loaded, prompt, layers=[1])
    assert [(m.layer, m.head) for m in maps] == [(1, h) for h in range(loaded.arch.num_attention_heads)]
    w = torch.tensor([m.weights for m in maps])  # [heads, s, s]
    s = w.shape[-1]
    assert s == len(maps[0].tokens) and torch.allclose(w.sum(-1), torch.ones(w.shape[:2]))
    assert bool((w.triu(1) == 0).all())
    attn = loaded.model.model.layers[1].self_attn
    seen = {}
    handle = attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False).ids
    with torch.no_grad():
        loaded.model(torch.tensor([ids]))
        handle.remove()
        v = attn.v_proj(seen["x"]).view(1, s, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)[0]
        cos, sin = loaded.model.rope(s, "cpu")
        out = attn(seen["x"], cos, sin)  # o_proj(SDPA): what the layer computed
    mine = attn.o_proj((w @ v).transpose(0, 1).reshape(1, s, -1))
    assert torch.allclose(mine, out, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "x " * 200}, "the model's context"), ({"prompt": "x", "layers": [7]}, "--layer 7 does not exist"),
    ({"prompt": "x", "heads": [-1]}, "--head -1 does not exist")])
def test_bad_selections_are_refused(loaded, kwargs, message):
    with pytest.raises(AttentionInputError) as err:
        attention_maps(loaded, **kwargs)
    assert message in err.value.message
