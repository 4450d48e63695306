"""Generation: greedy equals transformers token for token, the cache equals recomputation,
sampling is reproducible, stop strings and streaming."""

from __future__ import annotations

import pytest
import torch

from apr.errors import AprError
from apr.generate.generate import GenerateOptions, encode_prompts, generate
from apr.generate.load import load_for_inference
from apr.generate.sampling import Sampling
from tests.generate.tiny_lm import shard_hf

GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def loaded(tiny_lm):
    return load_for_inference(tiny_lm.checkpoint)


def prompts(lm) -> list[str]:
    """Prompts of several lengths: memorised text, a partial line, and text the model never saw."""
    return [lm.lines[2] + "\n", lm.lines[7][:9], "def spam(eggs):\n    return", "x"]


def test_greedy_equals_transformers_generate_token_for_token(tiny_lm, loaded, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_lm.hf_dir)).eval()
    for text in prompts(tiny_lm):
        ids = loaded.tokenizer.encode(text).ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False)
        want = out[0, len(ids):].tolist()
        got = generate(loaded, [text], GenerateOptions(max_new_tokens=24, sampling=GREEDY)).generations[0]
        assert got.token_ids == want, text
        assert len(want) > 0


def test_loading_the_hf_export_and_the_run_dir_gives_the_same_text(tiny_lm, loaded):
    opts = GenerateOptions(max_new_tokens=16, sampling=GREEDY)
    want = [g.token_ids for g in generate(loaded, prompts(tiny_lm), opts).generations]
    for source in (tiny_lm.hf_dir, tiny_lm.run_dir):
        other = load_for_inference(source)
        assert [g.token_ids for g in generate(other, prompts(tiny_lm), opts).generations] == want


def test_a_sharded_hf_folder_generates_what_transformers_and_the_checkpoint_do(tiny_lm, loaded, tmp_path,
                                                                               monkeypatch):
    """The export re-sharded into 2 files and an index (what save_pretrained writes for a large
    model): transformers loads it, and apr generates the same tokens from it as from the checkpoint."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    folder = shard_hf(tiny_lm.hf_dir, tmp_path / "sharded")
    assert not (folder / "model.safetensors").exists() and len(list(folder.glob("model-*.safetensors"))) == 2
    sharded = load_for_inference(folder)
    assert sharded.kind == "hf" and sharded.eos_id == loaded.eos_id
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    opts = GenerateOptions(max_new_tokens=16, sampling=GREEDY)
    ours = [g.token_ids for g in generate(sharded, prompts(tiny_lm), opts).generations]
    assert ours == [g.token_ids for g in generate(loaded, prompts(tiny_lm), opts).generations]
    for text, got in zip(prompts(tiny_lm), ours, strict=True):
        ids = sharded.tokenizer.encode(text).ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, do_sample=False)
        assert got == out[0, len(ids):].tolist(), text


def test_kv_cache_equals_recomputing_every_position(tiny_lm, loaded):
    for sampling in (GREEDY, Sampling(temperature=0.7, top_k=20)):
        opts = dict(max_new_tokens=20, sampling=sampling, seed=3, logprobs=True)
        cached = generate(loaded, [prompts(tiny_lm)[0]], GenerateOptions(**opts)).generations[0]
        full = generate(loaded, [prompts(tiny_lm)[0]], GenerateOptions(use_cache=False, **opts)).generations[0]
        assert cached.token_ids == full.token_ids
        torch.testing.assert_close(torch.tensor(cached.logprobs), torch.tensor(full.logprobs), atol=1e-4, rtol=0)


def test_a_batch_of_prompts_of_different_lengths_equals_each_prompt_alone(tiny_lm, loaded):
    opts = GenerateOptions(max_new_tokens=16, sampling=GREEDY)
    batch = generate(loaded, prompts(tiny_lm), opts).generations
    for text, got in zip(prompts(tiny_lm), batch, strict=True):
        alone = generate(loaded, [text], opts).generations[0]
        assert got.token_ids == alone.token_ids
        assert got.text == alone.text


def test_seeded_sampling_is_reproducible_and_the_seed_matters(tiny_lm, loaded):
    def sample(seed):
        opts = GenerateOptions(max_new_tokens=24, sampling=Sampling(temperature=1.5), seed=seed, stop_at_eos=False)
        return [g.token_ids for g in generate(loaded, prompts(tiny_lm), opts).generations]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    result = generate(loaded, ["x"], GenerateOptions(max_new_tokens=2, sampling=Sampling(temperature=1.0)))
    assert isinstance(result.seed, int)  # a random seed is reported so the sample can be repeated


def test_temperature_zero_and_top_k_one_are_greedy(tiny_lm, loaded):
    def ids(sampling, seed=0):
        opts = GenerateOptions(max_new_tokens=20, sampling=sampling, seed=seed)
        return [g.token_ids for g in generate(loaded, prompts(tiny_lm), opts).generations]

    greedy = ids(Sampling(greedy=True))
    assert ids(Sampling(temperature=0)) == greedy
    assert ids(Sampling(temperature=1.3, top_k=1), seed=1) == greedy
    assert ids(Sampling(temperature=1.3, top_k=1), seed=2) == greedy


def test_generation_stops_at_eos_max_new_tokens_or_the_context(tiny_lm, loaded):
    g = generate(loaded, ["x"], GenerateOptions(max_new_tokens=5, sampling=GREEDY, stop_at_eos=False)).generations[0]
    assert len(g.token_ids) == 5 and g.finish_reason == "length"
    long_prompt = " ".join(tiny_lm.lines)
    ids = loaded.tokenizer.encode(long_prompt).ids[: loaded.context - 3]
    text = loaded.tokenizer.decode(ids)
    n = len(encode_prompts(loaded, [text])[0])
    g = generate(loaded, [text], GenerateOptions(max_new_tokens=50, sampling=GREEDY, stop_at_eos=False)).generations[0]
    assert g.finish_reason == "context" and n + len(g.token_ids) == loaded.context


def test_a_stop_string_ends_the_text_before_it_and_streaming_joins_to_the_text(tiny_lm, loaded):
    text = prompts(tiny_lm)[0]
    free = generate(loaded, [text], GenerateOptions(max_new_tokens=24, sampling=GREEDY)).generations[0]
    assert len(free.text) > 6
    stop = free.text[4:6]
    pieces: list[str] = []
    cut = generate(loaded, [text], GenerateOptions(max_new_tokens=24, sampling=GREEDY, stop=(stop,)),
                   on_text=lambda i, t: pieces.append(t)).generations[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert "".join(pieces) == cut.text
    assert len(cut.token_ids) <= len(free.token_ids)

    streamed: list[str] = []
    g = generate(loaded, [text], GenerateOptions(max_new_tokens=24, sampling=GREEDY),
                 on_text=lambda i, t: streamed.append(t)).generations[0]
    assert "".join(streamed) == g.text and len(streamed) > 1


def test_logprobs_are_the_models_log_probabilities_of_the_chosen_tokens(tiny_lm, loaded):
    text = prompts(tiny_lm)[2]
    g = generate(loaded, [text], GenerateOptions(max_new_tokens=4, sampling=GREEDY, logprobs=True)).generations[0]
    ids = loaded.tokenizer.encode(text).ids
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids + g.token_ids]))[0]
    want = torch.log_softmax(logits, -1)[len(ids) - 1:-1].gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(g.logprobs), want, atol=1e-4, rtol=0)


def test_an_empty_prompt_and_one_longer_than_the_context_are_refused(tiny_lm, loaded):
    with pytest.raises(AprError, match="empty"):
        encode_prompts(loaded, [""])
    with pytest.raises(AprError, match="context is 96") as err:
        encode_prompts(loaded, ["ok", " ".join(tiny_lm.lines)])
    assert err.value.findings[0].path == "prompt 2"


def test_a_hostile_safetensors_header_in_an_hf_folder_is_refused_before_the_library_reads_it(untrained_lm,
                                                                                             tmp_path):
    import shutil
    import struct

    folder = tmp_path / "hf"
    shutil.copytree(untrained_lm.hf_dir, folder)
    head = b'{"a":[' + b"[]," * 1_000_000 + b"[]]}"  # a million lists: gigabytes once parsed
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(AprError) as err:
        load_for_inference(folder)
    assert "more than 100000 tensors" in str(err.value)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_the_plans_kv_cache_bytes_per_token_are_what_generate_holds(attention, tmp_path, monkeypatch):
    """`apr train plan`'s KV cache per token equals the bytes of the cache tensors a generate of n
    tokens allocated, divided by the positions they hold (rows x (longest prompt + n)); latent
    attention holds far less than grouped-query attention of the same heads."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from apr.fmt import format_bytes
    from apr.generate import generate as generate_module
    from apr.generate.decode import KVCache
    from apr.generate.load import Loaded
    from apr.model.llama import build_model
    from apr.plan.build import build_plan
    from apr.plan.render import render_text
    from tests.train.run_helpers import make_dataset, write_config

    make_dataset(tmp_path, train_rows=8, val_rows=4)
    arch = {} if attention == "gqa" else {"num_key_value_heads": None, "attention": {
        "kind": "mla", "kv_lora_rank": 6, "qk_rope_head_dim": 4}}
    plan = build_plan(write_config(tmp_path, model={"architecture": arch}, training={"max_steps": 4}))
    assert plan.errors == []
    per_token = plan.facts["model"]["kv_cache_bytes_per_token"]
    assert per_token == (2 * 2 * (8 + 8) * 4 if attention == "gqa" else 2 * (6 + 4) * 4)  # layers x ... x float32
    shown = render_text(plan)
    assert f"KV cache {format_bytes(per_token)}/token at generation" in shown
    assert ("multi-head latent attention: keys and values from a 6-wide latent" in shown) == (attention == "mla")
    caches = []

    class Recorded(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(generate_module, "KVCache", Recorded)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *"abcdefgh"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    loaded = Loaded(model=build_model(plan.config.model.architecture, 0).eval(), tokenizer=tok, tokenizer_path=None,
                    source=tmp_path, kind="run", step=None, eos_id=None)
    n = 5
    result = generate(loaded, ["a b c", "d e"], GenerateOptions(max_new_tokens=n, sampling=GREEDY, stop_at_eos=False))
    assert [len(g.token_ids) for g in result.generations] == [n, n]
    (cache,) = caches
    held = sum(t.untyped_storage().nbytes() for t in (cache.k, cache.v, cache.latent, cache.rope_key) if t is not None)
    assert held / (2 * (3 + n)) == per_token == result.kv_cache_bytes_per_token
