"""Scoring multiple-choice examples by log-likelihood, as lm-evaluation-harness does.

For each choice, ``context + choice`` is tokenized as one text (so the choice's first characters
merge with the context's last as they would in running text) and the choice's score is the sum of
the log-probabilities of the tokens after the longest prefix it shares with the tokens of
``context`` alone. When the boundary merges (a context ending in a newline and a choice starting
with spaces, with a GPT-2-style tokenizer), the scored tokens begin with that merged token.
``acc`` counts the examples whose highest score is the gold choice; ``acc_norm`` divides each
score by the choice's length in characters first (lm-evaluation-harness's acc_norm). A sequence
longer than the model's context keeps its last tokens (the context is cut from the left).
"""

from __future__ import annotations

from dataclasses import dataclass

from apr.evaluate.tasks import Example, Task


@dataclass
class TaskScore:
    name: str
    examples: int
    skipped: int
    acc: float
    acc_norm: float
    chance: float  # expected acc of a uniform guess: mean of 1 / number of choices
    source: str

    def to_dict(self) -> dict:
        return {"name": self.name, "examples": self.examples, "skipped": self.skipped, "acc": self.acc,
                "acc_norm": self.acc_norm, "chance": self.chance, "source": self.source}


def continuation_ids(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(the tokens conditioned on, the tokens scored) for one choice."""
    ctx = tokenizer.encode(context, add_special_tokens=False).ids
    whole = tokenizer.encode(context + choice, add_special_tokens=False).ids
    common = 0
    while common < min(len(ctx), len(whole)) and ctx[common] == whole[common]:
        common += 1
    if common == 0 or common == len(whole):  # nothing to condition on, or nothing left to score
        return ctx, tokenizer.encode(choice, add_special_tokens=False).ids
    return whole[:common], whole[common:]


def choice_logliks(loaded, example: Example) -> list[float]:
    """Summed log-probability of each choice's tokens after the context."""
    import torch

    model, device, context = loaded.model, loaded.device, loaded.context
    seqs, spans = [], []
    for choice in example.choices:
        ctx, cont = continuation_ids(loaded.tokenizer, example.context, choice)
        seq = (ctx + cont)[-(context + 1):]
        cont = cont[-(len(seq) - 1):]  # a choice longer than the context keeps its last tokens
        seqs.append(seq)
        spans.append((len(seq) - 1 - len(cont), len(cont)))  # first input position predicting cont
    width = max(len(s) for s in seqs) - 1
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s) - 1] = torch.tensor(s[:-1])
    with torch.inference_mode():
        h = model.model.norm(model.hidden_states(ids.to(device)))
        out = []
        for i, (start, n) in enumerate(spans):
            logits = torch.nn.functional.linear(h[i, start:start + n], model.head_weight).float()
            target = torch.tensor(seqs[i][start + 1:start + 1 + n], device=device)
            out.append(float(torch.log_softmax(logits, -1).gather(1, target[:, None]).sum()))
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal scores, as np.argmax


def score_task(loaded, task: Task) -> TaskScore:
    hits = hits_norm = 0
    chance = 0.0
    for ex in task.examples:
        ll = choice_logliks(loaded, ex)
        hits += _argmax(ll) == ex.gold
        hits_norm += _argmax([v / len(c) for v, c in zip(ll, ex.choices, strict=True)]) == ex.gold
        chance += 1 / len(ex.choices)
    n = len(task.examples)
    return TaskScore(name=task.name, examples=n, skipped=len(task.skipped), acc=hits / n, acc_norm=hits_norm / n,
                     chance=chance / n, source=task.source)
