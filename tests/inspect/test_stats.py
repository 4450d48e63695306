"""Weight statistics streamed in slices: the same numbers as torch on the whole tensor, reads no
larger than the chunk, non-finite values counted and kept out, norms out of the layer histogram."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from apr.checkpoint.sources import open_source  # noqa: E402
from apr.inspect import stats as stats_mod  # noqa: E402
from apr.inspect.stats import layer_of, weight_stats  # noqa: E402
from tests.inspect.conftest import write  # noqa: E402


@pytest.mark.parametrize("name, layer", [
    ("model.layers.12.self_attn.q_proj.weight", "layers.12"), ("model.embed_tokens.weight", "embed_tokens"),
    ("lm_head.weight", "lm_head"), ("model.norm.weight", "norm"),
    ("model.layers.3.mlp.up_proj.lora_A", "layers.3")])
def test_layer_of_names(name, layer):
    assert layer_of(name) == layer


def test_statistics_match_torch_and_layers_come_in_model_order(weights_file):
    path, tensors = weights_file
    layers, per_tensor = weight_stats(open_source(path), bins=10)
    assert [r.layer for r in layers] == ["embed_tokens", "layers.0", "layers.1", "norm"]
    emb = next(t for t in per_tensor if t.name == "model.embed_tokens.weight")
    x = tensors["model.embed_tokens.weight"].double()
    assert emb.stats["mean"] == pytest.approx(float(x.mean()))
    assert emb.stats["std"] == pytest.approx(float(x.std(unbiased=False)))
    assert (emb.stats["min"], emb.stats["max"]) == (pytest.approx(float(x.min())), pytest.approx(float(x.max())))
    layer0 = layers[1]
    # the histogram covers the layer's matrix only: the layernorm's ones would sit far outside it
    assert sum(layer0.counts) == 16 * 8 and layer0.stats["numel"] == 16 * 8 and layer0.tensors == 2
    assert layer0.bin_edges[0] == pytest.approx(layer0.stats["min"]) and len(layer0.bin_edges) == 11


def test_reads_are_bounded_by_the_chunk_and_change_nothing(weights_file, monkeypatch):
    path, _ = weights_file
    whole = weight_stats(open_source(path), bins=8)
    monkeypatch.setattr(stats_mod, "CHUNK_ELEMENTS", 64)  # the embedding (400 elements) in 8-row slices
    source = open_source(path)
    sizes = []
    rows = source.rows

    def spy(name, start, stop):
        out = rows(name, start, stop)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(source, "rows", spy)
    chunked = weight_stats(source, bins=8)
    assert max(sizes) <= 64 and len(sizes) > 10
    assert [r.counts for r in chunked[0]] == [r.counts for r in whole[0]]
    for a, b in zip(chunked[1], whole[1], strict=True):
        assert a.stats == pytest.approx(b.stats)


def test_nonfinite_values_are_counted_not_averaged(tmp_path):
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    layers, tensors = weight_stats(open_source(write(tmp_path / "bad.safetensors", {"model.layers.0.w": x})))
    s = tensors[0].stats
    assert s["nonfinite"] == 2 and s["mean"] == 2.0 and s["numel"] == 4 and sum(layers[0].counts) == 2
