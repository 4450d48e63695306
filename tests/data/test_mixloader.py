"""apr/data/mixloader.py: rows drawn per the planned mixture, stage switch at the planned step, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from apr.data.mixloader import MixtureLoader
from apr.data.mixplan import Stage, account
from apr.data.mixture import MixtureError
from apr.data.shards import write_dataset

SEQ = 5
SIZES = {"web": 40, "code": 24, "books": 12}
BASE = {"web": 0, "code": 1000, "books": 2000}  # row i of a source starts with BASE + i


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, n in SIZES.items():
        rows = (BASE[name] + np.arange(n)[:, None] + np.arange(SEQ + 1)[None, :]).astype(np.uint32)
        write_dataset(root / name, {"train": rows}, {"seq_len": SEQ}, 10)
        out[name] = root / name / "train"
    return out


def loader(sources, stages, total_steps, **kw):
    kw.setdefault("batch_size", 4)
    return MixtureLoader(sources, stages, total_steps=total_steps, seq_len=SEQ, seed=3, cache_dir=False, **kw)


def ids(batch) -> list[tuple[str, int]]:
    out = []
    for first in batch[:, 0].tolist():
        name = max((n for n in BASE if BASE[n] <= first), key=BASE.get)
        out.append((name, first - BASE[name]))
    return out


def test_three_sources_draw_the_planned_rows_and_tokens(sources):
    st = [Stage({"web": 0.5, "code": 0.3, "books": 0.2})]
    ld = loader(sources, st, total_steps=50)
    seen = []
    for _ in range(50):
        batch = ld.next_batch()
        assert batch.shape == (4, SEQ + 1)
        assert ids(batch) == ld.last_rows  # the rows handed out are the ones recorded
        seen += ld.last_rows
    assert ld.rows_seen == {"web": 100, "code": 60, "books": 40}
    acc = account(st, SIZES, tokens_per_row=SEQ, rows_per_step=4, total_steps=50, seed=3)
    assert ld.rows_seen == acc["rows"] and ld.tokens_seen == acc["tokens"]
    for name, n in SIZES.items():  # each epoch of a source visits every row once
        rows = [r for s, r in seen if s == name]
        full = len(rows) // n * n
        assert sorted(rows[:full]) == sorted(list(range(n)) * (full // n))


def test_two_stages_switch_mix_at_the_planned_step_exactly(sources):
    st = [Stage({"web": 1.0}), Stage({"books": 1.0}, start=0.6)]
    ld = loader(sources, st, total_steps=20, gradient_accumulation=2)
    for step in range(20):
        names = set()
        for _ in range(2):  # micro-batches of the step
            names |= {n for n, _ in ids(ld.next_batch())}
        assert names == ({"web"} if step < 12 else {"books"}), step


@pytest.mark.parametrize("stop", [7, 12, 13])
def test_resume_from_saved_state_sees_the_same_rows(sources, stop):
    st = [Stage({"web": 0.6, "code": 0.4}), Stage({"web": 0.2, "code": 0.3, "books": 0.5}, start=12)]
    whole = loader(sources, st, total_steps=30)
    expected = []
    for _ in range(30):
        whole.next_batch()
        expected += whole.last_rows
    first = loader(sources, st, total_steps=30)
    got = []
    for _ in range(stop):
        first.next_batch()
        got += first.last_rows
    state = json.loads(json.dumps(first.state_dict()))  # as saved in a checkpoint
    again = loader(sources, st, total_steps=30)
    again.load_state_dict(state)
    for _ in range(30 - stop):
        got += ids(again.next_batch())
    assert got == expected
    assert again.rows_seen == whole.rows_seen


def test_ranks_take_disjoint_slices_of_each_global_batch(sources):
    st = [Stage({"web": 0.5, "code": 0.5})]
    one = loader(sources, st, total_steps=10, batch_size=4)
    ranks = [loader(sources, st, total_steps=10, batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(10):
        one.next_batch()
        parts = [ids(r.next_batch()) for r in ranks]
        assert parts[0] + parts[1] == one.last_rows


def test_a_state_for_other_data_is_refused(sources):
    st = [Stage({"web": 1.0})]
    state = loader(sources, st, total_steps=10).state_dict()
    state["rows"]["web"] = 41
    with pytest.raises(MixtureError, match="rows was"):
        loader(sources, st, total_steps=10).load_state_dict(state)


def test_rows_of_an_old_micro_batch_are_replayed_and_the_cursor_stays(sources):
    st = [Stage({"web": 0.5, "code": 0.3, "books": 0.2})]
    ld = loader(sources, st, total_steps=400)
    seen = []
    for _ in range(300):  # more than the kept window
        ld.next_batch()
        seen.append(list(ld.last_rows))
    state, last = ld.state_dict(), list(ld.last_rows)
    offsets = {"web": 0, "code": SIZES["web"], "books": SIZES["web"] + SIZES["code"]}
    assert ld.rows_at(3) == [offsets[s] + r for s, r in seen[3]]  # replayed from the start
    assert ld.rows_at(299) == [offsets[s] + r for s, r in seen[299]]  # kept
    assert ld.state_dict() == state and ld.last_rows == last  # the cursor did not move
    nxt = ld.next_batch()
    ref = loader(sources, st, total_steps=400)
    for _ in range(301):
        want = ref.next_batch()
    assert nxt.equal(want)
