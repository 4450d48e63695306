"""The sampling rules against transformers' logits processors, on random logits."""

from __future__ import annotations

import pytest
import torch

from apr.errors import AprError
from apr.generate.sampling import Sampling, choose, filter_logits, penalise_repeats


@pytest.fixture
def logits():
    return torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3


def test_top_k_and_top_p_match_transformers(logits):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    for k in (1, 5, 49):
        assert torch.equal(filter_logits(logits, k, 1.0), TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.1, 0.5, 0.9, 0.999):
        assert torch.equal(filter_logits(logits, 0, p), TopPLogitsWarper(p)(None, logits.clone()))
    kept = torch.isfinite(filter_logits(logits, 0, 0.5)).sum(-1)
    assert (kept >= 1).all() and (kept < 50).all()


def test_repetition_penalty_matches_transformers(logits):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    seen = torch.tensor([[1, 2, 2, 7], [0, 0, 0, 0], [49, 3, 5, 8]])
    for penalty in (1.0, 1.3, 0.8):
        want = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
        assert torch.equal(penalise_repeats(logits, seen, penalty), want)


def test_greedy_choice_is_the_argmax_and_sampling_follows_the_generator(logits):
    seen = torch.zeros(3, 1, dtype=torch.long)
    assert torch.equal(choose(logits, seen, Sampling(temperature=0), None), logits.argmax(-1))

    def draw(seed):
        return choose(logits, seen, Sampling(temperature=2.0), torch.Generator().manual_seed(seed))

    assert torch.equal(draw(1), draw(1))
    assert any(not torch.equal(draw(1), draw(s)) for s in range(2, 6))


@pytest.mark.parametrize("kw, option", [({"temperature": -1}, "--temperature"), ({"top_k": -2}, "--top-k"),
                                         ({"top_p": 0}, "--top-p"), ({"top_p": 1.5}, "--top-p"),
                                         ({"repetition_penalty": 0}, "--repetition-penalty")])
def test_out_of_range_settings_name_the_option(kw, option):
    with pytest.raises(AprError) as err:
        Sampling(**kw)
    assert err.value.findings[0].path == option
