"""Inference latency: prefill and per-token decode through the KV cache ``apr generate`` uses
(``apr.generate.decode``), at given prompt lengths, with p50/p99 over repeats."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from apr.errors import AprError, Finding
from apr.generate.decode import KVCache, forward_cached
from apr.profile.clock import Clock, percentile


class PromptTooLong(AprError):
    """A prompt length plus the tokens to decode does not fit the model's context."""


@dataclass
class LatencyRow:
    prompt_tokens: int
    new_tokens: int
    batch_size: int
    repeats: int
    prefill_p50_s: float
    prefill_p99_s: float
    decode_p50_s: float  # one decoded position of every row
    decode_p99_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float  # decoded tokens (all rows) per second, from the mean step
    kv_cache_bytes: int  # keys and values of every layer for prompt + new tokens
    kv_bytes_per_token: int  # per position of one row

    def to_dict(self) -> dict:
        return asdict(self)


def prompt_ids(base: list[int], length: int, vocab_size: int) -> list[int]:
    """``length`` ids: ``base`` (a prompt's tokens) repeated, or a fixed pseudo-random sequence when
    no prompt was given, so runs compare across checkpoints."""
    if not base:
        return [(i * 7919 + 13) % vocab_size for i in range(length)]
    return (base * (length // len(base) + 1))[:length]


def check_lengths(lengths: list[int], new_tokens: int, context: int) -> None:
    for length in lengths:
        if length < 1 or length + new_tokens > context:
            raise PromptTooLong(
                f"a prompt of {length} tokens plus {new_tokens} new tokens does not fit the model's context of "
                f"{context} positions", [Finding(
                    "error", "profile.prompt_too_long", "prompt longer than the context allows", path="--length",
                    expected=f"1 to {context - new_tokens} tokens (context {context} - {new_tokens} new)",
                    got=f"{length} tokens")])


def _one_run(model, ids: torch.Tensor, new_tokens: int, clock: Clock) -> tuple[float, list[float], int]:
    """Prefill ``ids`` then decode ``new_tokens`` greedily: (prefill s, each decode step's s, cache bytes)."""
    cache = KVCache(model, ids.shape[0], ids.shape[1] + new_tokens)
    clock.sync()
    t0 = time.perf_counter()
    logits = forward_cached(model, ids, cache)
    token = logits.argmax(-1, keepdim=True)  # argmax then .item-free feed: the step's real work
    clock.sync()
    prefill = time.perf_counter() - t0
    steps = []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        token = forward_cached(model, token, cache).argmax(-1, keepdim=True)
        clock.sync()
        steps.append(time.perf_counter() - t0)
    return prefill, steps, cache.nbytes


def measure_latency(model, base_ids: list[int], lengths: list[int], *, new_tokens: int = 32, batch_size: int = 1,
                    repeats: int = 5) -> list[LatencyRow]:
    """One row per prompt length: ``repeats`` prefills and ``repeats * new_tokens`` decode steps
    after one warm-up run per length."""
    model.eval()
    context = model.arch.max_position_embeddings
    check_lengths(lengths, new_tokens, context)
    device = model.model.embed_tokens.weight.device
    clock = Clock(device)
    rows = []
    for length in lengths:
        ids = torch.tensor([prompt_ids(base_ids, length, model.arch.vocab_size)] * batch_size, device=device)
        _one_run(model, ids, min(new_tokens, 2), clock)
        prefills, decodes, kv = [], [], 0
        for _ in range(repeats):
            prefill, steps, kv = _one_run(model, ids, new_tokens, clock)
            prefills.append(prefill)
            decodes += steps
        mean_decode = sum(decodes) / len(decodes) if decodes else 0.0
        mean_prefill = sum(prefills) / len(prefills)
        rows.append(LatencyRow(
            prompt_tokens=length, new_tokens=new_tokens, batch_size=batch_size, repeats=repeats,
            prefill_p50_s=percentile(prefills, 50), prefill_p99_s=percentile(prefills, 99),
            decode_p50_s=percentile(decodes, 50) if decodes else 0.0,
            decode_p99_s=percentile(decodes, 99) if decodes else 0.0,
            prefill_tokens_per_s=batch_size * length / mean_prefill if mean_prefill > 0 else 0.0,
            decode_tokens_per_s=batch_size / mean_decode if mean_decode > 0 else 0.0,
            kv_cache_bytes=kv, kv_bytes_per_token=kv // (batch_size * (length + new_tokens))))
    return rows
