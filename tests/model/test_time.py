"""Time conditioning (apr/model/time.py): each row's drawn step, and the time embedding the token
embedding adds to every position of its row."""

from __future__ import annotations

import math

import pytest
import torch

from apr.model.llama import build_model
from apr.model.time import conditioned, row_steps
from tests.train.tiny import make_config


def test_each_rows_step_depends_on_the_seed_the_step_and_its_tokens_only_and_covers_the_steps():
    rows = torch.randint(0, 50, (400, 6), generator=torch.Generator().manual_seed(0))
    steps = row_steps(rows, 4, seed=7, step=3)
    assert torch.equal(row_steps(rows[10:11], 4, 7, 3), steps[10:11])  # alone, as in any micro-batch or rank
    assert torch.equal(row_steps(rows.flip(0), 4, 7, 3), steps.flip(0))
    assert not torch.equal(row_steps(rows, 4, 7, 4), steps) and not torch.equal(row_steps(rows, 4, 8, 3), steps)
    counts = torch.bincount(steps, minlength=4).tolist()
    assert len(counts) == 4 and all(70 <= c <= 130 for c in counts), counts  # t uniform in [0, 1]


@pytest.mark.parametrize("encoding", ["sinusoidal", "learned"])
def test_the_token_embedding_adds_the_projected_time_embedding_of_its_row_to_every_position(encoding):
    time = {"embedding_dim": 4, "num_time_steps": 10, "encoding": encoding, "eval_time": 0.35}
    model = build_model(make_config(model={"architecture": {"time": time}}).model.architecture, seed=0)
    te, ids = model.model.time_embedding, torch.tensor([[1, 2, 3], [4, 5, 6]])
    tokens = torch.nn.functional.embedding(ids, model.model.embed_tokens.weight)
    if encoding == "sinusoidal":  # half = 2 frequencies: 1 and 10000^-1/2
        code = {s: torch.tensor([math.sin(s), math.sin(s / 100), math.cos(s), math.cos(s / 100)]) for s in (3, 8)}
    else:
        code = {s: te.table.weight[s].detach() for s in (3, 8)}
    with torch.no_grad(), conditioned(model, torch.tensor([3, 8])):
        got = model.model.embed_tokens(ids)
    for row, s in enumerate((3, 8)):
        want = tokens[row] + te.proj.weight.detach() @ code[s]
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # outside training: every row at eval_time's step, floor(0.35 x 10) = 3
        fixed = model.model.embed_tokens(ids)
    torch.testing.assert_close(fixed[0], got[0])
    torch.testing.assert_close(fixed[1], got[0] - tokens[0] + tokens[1])  # row 1's tokens at step 3
    assert te.fixed_step == 3 and te.row_steps is None
