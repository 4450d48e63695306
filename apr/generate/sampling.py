"""How the next token is chosen from the model's logits.

The order is Hugging Face ``generate``'s: repetition penalty, then temperature, then top-k, then
top-p; greedy takes the arg-max. Temperature 0 means greedy, and so does top-k 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apr.errors import AprError, Finding


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off; > 1 discourages tokens already in the sequence
    greedy: bool = False

    def __post_init__(self):
        def bad(option: str, expected: str, got) -> AprError:
            return AprError(f"{option} must be {expected}, not {got}", [Finding(
                "error", "generate.option", f"{option} out of range", path=option, expected=expected, got=str(got))])

        if not self.temperature >= 0:
            raise bad("--temperature", ">= 0", self.temperature)
        if self.top_k < 0:
            raise bad("--top-k", ">= 0", self.top_k)
        if not 0 < self.top_p <= 1:
            raise bad("--top-p", "in (0, 1]", self.top_p)
        if not self.repetition_penalty > 0:
            raise bad("--repetition-penalty", "> 0", self.repetition_penalty)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0 or self.top_k == 1


def penalise_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Divide positive (multiply negative) logits of every token in ``seen`` ``[batch, n]`` by
    ``penalty`` (CTRL's rule, as HF applies it)."""
    if penalty == 1.0:
        return logits
    picked = logits.gather(1, seen)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(1, seen, picked)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top ``top_k`` and outside the smallest set whose
    probability reaches ``top_p`` (the most likely token always stays)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose(logits: torch.Tensor, seen: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row ``[batch]`` from float32 ``logits`` ``[batch, vocab]``."""
    # clamped, then shifted so the largest is 0: an extreme temperature or penalty (1e-300) gives
    # -inf and 0, never inf - inf (NaN probabilities the sampler refuses)
    big = torch.finfo(logits.dtype).max / 4
    logits = penalise_repeats(logits, seen, sampling.repetition_penalty).clamp(-big, big)
    if sampling.is_greedy or sampling.temperature < torch.finfo(logits.dtype).tiny:  # 1e-300 is 0 in float32
        return logits.argmax(-1)
    logits = logits - logits.amax(-1, keepdim=True)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = logits.softmax(-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)
