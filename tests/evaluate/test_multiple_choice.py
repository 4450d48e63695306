"""Multiple-choice scoring: 100% on memorised text, chance on shuffled gold, acc vs acc_norm."""

from __future__ import annotations

import random

import pytest

from apr.evaluate import multiple_choice
from apr.evaluate.multiple_choice import continuation_ids, score_task
from apr.evaluate.tasks import Example, Task


def memorised_task(lines: list[str], seed: int = 0) -> list[tuple[str, str, list[str]]]:
    """(context, the real next line, three other lines of the same text) for each line."""
    rng = random.Random(seed)
    out = []
    for i in range(2, len(lines)):
        others = rng.sample([line for j, line in enumerate(lines) if j != i], 3)
        out.append((lines[i - 2] + "\n" + lines[i - 1] + "\n", lines[i], others))
    return out


def as_task(items, gold_of) -> Task:
    examples = []
    for k, (context, real, others) in enumerate(items):
        choices = list(others)
        choices.insert(k % 4, real)
        examples.append(Example(context=context, choices=tuple(choices), gold=gold_of(k, choices.index(real))))
    return Task(name="memorised", examples=examples, source="test")


def test_the_memorised_next_line_scores_100_percent(tiny_lm, loaded):
    task = as_task(memorised_task(tiny_lm.lines), gold_of=lambda k, real: real)
    score = score_task(loaded, task)
    assert score.examples == len(tiny_lm.lines) - 2
    assert score.acc == 1.0 and score.acc_norm == 1.0
    assert score.chance == 0.25


def test_shuffled_gold_scores_about_chance(tiny_lm, loaded):
    rng = random.Random(5)
    golds = [rng.randrange(4) for _ in range(len(tiny_lm.lines) - 2)]
    task = as_task(memorised_task(tiny_lm.lines), gold_of=lambda k, real: golds[k])
    expected = sum(golds[k] == k % 4 for k in range(len(golds))) / len(golds)  # the model still picks the real line
    score = score_task(loaded, task)
    assert score.acc == pytest.approx(expected)
    assert score.acc <= 0.5


def test_acc_norm_divides_the_log_likelihood_by_the_choice_length(monkeypatch):
    monkeypatch.setattr(multiple_choice, "choice_logliks", lambda loaded, ex: [-2.0, -4.0])
    task = Task(name="t", examples=[Example("ctx", ("a", "bbbb"), gold=1)], source="test")
    score = score_task(None, task)
    assert score.acc == 0.0  # -2 > -4: the short choice wins on the sum
    assert score.acc_norm == 1.0  # -4/4 > -2/1: the long choice wins per character


def test_a_leading_space_of_the_choice_merges_as_in_running_text(loaded):
    ctx, cont = continuation_ids(loaded.tokenizer, "import", " json")
    whole = loaded.tokenizer.encode("import json").ids
    assert ctx + cont == whole
