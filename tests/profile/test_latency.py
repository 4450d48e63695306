"""Inference latency rows: percentiles, KV-cache size from the model's shapes, and prompts that do
not fit the context refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from apr.config.schema import Architecture  # noqa: E402
from apr.model.llama import build_model  # noqa: E402
from apr.profile.clock import percentile  # noqa: E402
from apr.profile.latency import PromptTooLong, measure_latency, prompt_ids  # noqa: E402

ARCH = Architecture.model_validate({
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64})


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [0.2, 0.9, 0.4, 0.1, 7.0, 0.3]])
def test_percentile_agrees_with_numpy(values):
    for q in (0, 50, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_prompt_ids_repeat_the_prompt_to_the_length():
    assert prompt_ids([1, 2, 3], 7, 128) == [1, 2, 3, 1, 2, 3, 1]
    fixed = prompt_ids([], 10, 128)
    assert len(fixed) == 10 and all(0 <= i < 128 for i in fixed) and fixed == prompt_ids([], 10, 128)


def test_rows_per_length_with_the_cache_size_of_the_shapes():
    model = build_model(ARCH, seed=0)
    rows = measure_latency(model, [], [8, 20], new_tokens=4, repeats=2)
    assert [r.prompt_tokens for r in rows] == [8, 20]
    per_position = 2 * ARCH.num_hidden_layers * ARCH.kv_heads * ARCH.head_dim * 4  # k and v, fp32
    for r in rows:
        assert r.kv_cache_bytes == per_position * (r.prompt_tokens + 4)
        assert r.kv_bytes_per_token == per_position
        assert 0 < r.prefill_p50_s <= r.prefill_p99_s and 0 < r.decode_p50_s <= r.decode_p99_s
        assert r.decode_tokens_per_s > 0


def test_a_prompt_past_the_context_is_refused_before_any_work():
    with pytest.raises(PromptTooLong) as err:
        measure_latency(build_model(ARCH, seed=0), [], [8, 62], new_tokens=4)
    assert "62 tokens plus 4 new tokens" in err.value.message and "context of 64" in err.value.message
    assert err.value.findings[0].expected.startswith("1 to 60")
