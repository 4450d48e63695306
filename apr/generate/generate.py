"""The generation loop: encode prompts, prefill the cache, pick tokens one position at a time,
stop at end-of-text, a stop string, ``max_new_tokens`` or the model's context, and stream the text
as it becomes final."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from apr.errors import AprError, Finding
from apr.generate.decode import KVCache, forward_cached, forward_full
from apr.generate.load import Loaded
from apr.generate.sampling import Sampling, choose

OnText = Callable[[int, str], None]  # (prompt index, newly final text)


@dataclass(frozen=True)
class GenerateOptions:
    max_new_tokens: int = 64
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one produced
    seed: int | None = None  # None: a fresh random seed, reported in the result
    use_cache: bool = True  # False recomputes the whole sequence for each token (slow; a check)
    logprobs: bool = False
    stop_at_eos: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise AprError(f"--max-new-tokens must be at least 1, not {self.max_new_tokens}", [Finding(
                "error", "generate.option", "max_new_tokens out of range", path="--max-new-tokens",
                expected=">= 1", got=str(self.max_new_tokens))])
        if any(s == "" for s in self.stop):
            raise AprError("a --stop string is empty", [Finding(
                "error", "generate.option", "empty stop string", path="--stop", expected="non-empty text",
                got="''")])


@dataclass
class Generation:
    prompt: str
    prompt_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids (an end-of-text id included when it ended the text)
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    logprobs: list[float] | None = None  # log-probability of each generated id under the model (T=1)

    def to_dict(self) -> dict:
        doc = {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
               "prompt_tokens": len(self.prompt_ids), "generated_tokens": len(self.token_ids),
               "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            doc["logprobs"] = self.logprobs
        return doc


@dataclass
class GenerateResult:
    generations: list[Generation]
    seed: int
    prefill_s: float
    decode_s: float
    decode_tokens: int  # positions decoded after the prefill, over all rows
    kv_cache_bytes_per_token: int | None = None  # what the KV cache held per position of a row (None: no cache)

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None


def encode_prompts(loaded: Loaded, prompts: list[str], max_new_tokens: int = 1,
                   origins: list[str] | None = None) -> list[list[int]]:
    """Token ids of each prompt; AprError for an empty prompt or one that leaves no room in the
    context, naming the prompt by ``origins[i]`` (where it came from) and never quoting it."""
    if not prompts:
        raise AprError("no prompt given", [Finding("error", "generate.no_prompt", "no prompt to continue",
                                                   path="--prompt", expected="at least one prompt", got="none")])
    out = []
    for i, text in enumerate(prompts):
        where = (origins[i] if origins is not None and i < len(origins)
                 else "--prompt" if len(prompts) == 1 else f"prompt {i + 1}")
        option = where.split(" ", 1)[0] if origins is not None else where  # the option, for the finding
        if not text:
            raise AprError(f"{where} is empty", [Finding(
                "error", "generate.empty_prompt", "empty prompt", path=option, expected="some text", got="''")])
        ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise AprError(f"{where} encodes to no tokens", [Finding(
                "error", "generate.empty_prompt", "the prompt has no tokens", path=option,
                expected="at least one token", got="0")])
        if len(ids) >= loaded.context:
            raise AprError(f"{where} is {len(ids)} tokens; the model's context is {loaded.context}, so it leaves "
                           "no room to generate", [Finding(
                               "error", "generate.prompt_too_long", "prompt longer than the context",
                               path=option, expected=f"fewer than {loaded.context} tokens",
                               got=f"{len(ids)} tokens")])
        out.append(ids)
    return out


class _Row:
    """One prompt's state: its generated ids, text so far and how much of it was streamed."""

    def __init__(self, prompt: str, prompt_ids: list[int], loaded: Loaded, options: GenerateOptions):
        self.prompt, self.prompt_ids = prompt, prompt_ids
        self.tok, self.options = loaded.tokenizer, options
        self.room = loaded.context - len(prompt_ids)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.emitted = 0
        self.finish: str | None = None

    def add(self, token: int, logprob: float | None, eos_id: int | None) -> None:
        self.ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.options.stop_at_eos and eos_id is not None and token == eos_id:
            self.finish = "eos"
            return
        self.text = self.tok.decode(self.ids)
        for s in self.options.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text = self.text[:at]
                self.finish = "stop"
        if self.finish is None and len(self.ids) >= self.options.max_new_tokens:
            self.finish = "length"
        elif self.finish is None and len(self.ids) >= self.room:
            self.finish = "context"

    def final_text(self) -> str:
        """The part of the text that cannot change any more: the end held back while it is an
        incomplete UTF-8 character or could still grow into a stop string."""
        if self.finish is not None:
            return self.text
        text = self.text.rstrip("\ufffd")
        hold = 0
        for s in self.options.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return text[: len(text) - hold]

    def stream(self, index: int, on_text: OnText | None) -> None:
        if on_text is None:
            return
        final = self.final_text()
        if len(final) > self.emitted:
            on_text(index, final[self.emitted:])
            self.emitted = len(final)


def generate(loaded: Loaded, prompts: list[str], options: GenerateOptions,
             on_text: OnText | None = None, origins: list[str] | None = None) -> GenerateResult:
    """Continue each prompt (all in one batch). ``on_text(i, text)`` receives prompt ``i``'s text
    as it becomes final; joined, the pieces are the generation's ``text``. ``origins``: where each
    prompt came from, for errors."""
    prompt_ids = encode_prompts(loaded, prompts, origins=origins)
    seed = options.seed if options.seed is not None else secrets.randbelow(2**31)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = [_Row(p, ids, loaded, options) for p, ids in zip(prompts, prompt_ids, strict=True)]
    step = _step_cached(loaded, prompt_ids, options) if options.use_cache else _step_full(loaded, prompt_ids)
    device = loaded.device
    longest = max(len(ids) for ids in prompt_ids)
    seen = torch.tensor([[ids[0]] * (longest - len(ids)) + ids for ids in prompt_ids], device=device)
    fed: torch.Tensor | None = None
    t0 = time.perf_counter()
    t_prefill = t0
    decoded = 0
    while True:
        logits = step(fed)
        if fed is None:
            t_prefill = time.perf_counter()
        else:
            decoded += sum(1 for r in rows if r.finish is None)
        tokens = choose(logits, seen, options.sampling, gen)
        logp = (torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1).tolist()
                if options.logprobs else [None] * len(rows))
        token_list = tokens.tolist()
        for i, row in enumerate(rows):
            if row.finish is None:
                row.add(token_list[i], logp[i], loaded.eos_id)
                row.stream(i, on_text)
        if all(r.finish is not None for r in rows):
            break
        fed = tokens[:, None]
        seen = torch.cat([seen, fed], 1)
    t1 = time.perf_counter()
    generations = [Generation(prompt=r.prompt, prompt_ids=r.prompt_ids, text=r.text, token_ids=r.ids,
                              finish_reason=r.finish or "length", logprobs=r.logprobs if options.logprobs else None)
                   for r in rows]
    return GenerateResult(generations, seed=seed, prefill_s=t_prefill - t0, decode_s=t1 - t_prefill,
                          decode_tokens=decoded, kv_cache_bytes_per_token=(
                              step.cache.bytes_per_token if hasattr(step, "cache") else None))


def _step_cached(loaded: Loaded, prompt_ids: list[list[int]], options: GenerateOptions):
    """A function: None -> prefill logits; ``[batch, 1]`` tokens -> next logits."""
    model, device = loaded.model, loaded.device
    longest = max(len(ids) for ids in prompt_ids)
    shortest = min(len(ids) for ids in prompt_ids)
    steps = min(options.max_new_tokens, loaded.context - shortest)
    cache = KVCache(model, len(prompt_ids), longest + steps)
    pad = None
    if shortest != longest:
        pad = torch.tensor([longest - len(ids) for ids in prompt_ids], device=device)
    padded = torch.tensor([[ids[0]] * (longest - len(ids)) + ids for ids in prompt_ids], device=device)

    def step(fed: torch.Tensor | None) -> torch.Tensor:
        return forward_cached(model, padded if fed is None else fed, cache, pad)

    step.cache = cache  # the caller reports its size
    return step


def _step_full(loaded: Loaded, prompt_ids: list[list[int]]):
    """Each row recomputed from its whole sequence for every token (no cache, no padding)."""
    model, device = loaded.model, loaded.device
    seqs = [list(ids) for ids in prompt_ids]

    def step(fed: torch.Tensor | None) -> torch.Tensor:
        if fed is not None:
            for seq, t in zip(seqs, fed[:, 0].tolist(), strict=True):
                seq.append(t)
        return torch.cat([forward_full(model, torch.tensor([seq], device=device)) for seq in seqs])

    return step
