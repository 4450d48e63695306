from collections import Counter

import pytest

from apr.data.mixplan import Stage, account, replay, stage_starts
from apr.data.mixture import MixtureError

ROWS = {"web": 50, "code": 30, "books": 20}


def test_three_sources_exact_counts_and_tokens():
    st = [Stage({"web": 0.5, "code": 0.3, "books": 0.2})]
    acc = account(st, ROWS, tokens_per_row=17, rows_per_step=4, total_steps=50, seed=7)
    assert acc["rows"] == {"web": 100, "code": 60, "books": 40}
    assert acc["tokens"] == {"web": 1700, "code": 1020, "books": 680}
    assert acc["epochs"] == {"web": 2.0, "code": 2.0, "books": 2.0}
    assert acc["findings"] == []


def test_two_stages_switch_at_the_planned_step_exactly():
    st = [Stage({"web": 1.0}), Stage({"books": 1.0}, start=0.75)]
    draws = replay(st, ROWS, rows_per_step=2, total_steps=20, seed=1)
    assert stage_starts(st, 20) == [0, 15]
    assert {s for s, n, _, _ in draws if n == "web"} == set(range(15))
    assert {s for s, n, _, _ in draws if n == "books"} == set(range(15, 20))
    acc = account(st, ROWS, tokens_per_row=1, rows_per_step=2, total_steps=20, seed=1)
    assert [s["start_step"] for s in acc["stages"]] == [0, 15]
    assert acc["stages"][1]["rows"] == {"web": 0, "code": 0, "books": 10}


def test_accounting_equals_the_replayed_draws():
    st = [Stage({"web": 0.6, "code": 0.4}), Stage({"web": 0.2, "code": 0.3, "books": 0.5}, start=7)]
    acc = account(st, ROWS, tokens_per_row=9, rows_per_step=3, total_steps=13, seed=5)
    seen = Counter(n for _, n, _, _ in replay(st, ROWS, rows_per_step=3, total_steps=13, seed=5))
    assert acc["rows"] == {n: seen[n] for n in ROWS}
    assert sum(acc["rows"].values()) == 39


def test_cursor_carries_across_a_stage_boundary():
    st = [Stage({"web": 1.0}), Stage({"web": 0.5, "books": 0.5}, start=3)]
    draws = replay(st, ROWS, rows_per_step=2, total_steps=6, seed=0)
    web_rows = [r for _, n, _, r in draws if n == "web"]
    assert web_rows == list(range(len(web_rows)))  # no re-read from row 0 at the switch


def test_epoch_warning_and_no_repeat_error():
    st = [Stage({"web": 0.5, "books": 0.5})]
    acc = account(st, ROWS, tokens_per_row=1, rows_per_step=10, total_steps=20, seed=0)
    assert [(f.level, "books" in f.message) for f in acc["findings"]] == [("warning", True)]  # 100/20 = 5 epochs
    acc = account(st, ROWS, tokens_per_row=1, rows_per_step=10, total_steps=20, seed=0, repeat=False)
    assert {f.level for f in acc["findings"]} == {"error"}
    assert any("'web' is exhausted" in f.message and "100 rows" in f.message for f in acc["findings"])


@pytest.mark.parametrize("stages, needle", [
    ([Stage({"web": -1.0})], "data.stages[0].weights"),
    ([Stage({"web": 0.0, "code": 0.0})], "all zero"),
    ([Stage({"nope": 1.0})], "data.stages[0].weights.nope"),
    ([Stage({"web": 1.0}), Stage({"code": 1.0}, start=40)],
     "data.stages[1].start: stage starts at step 40, after the run"),
    ([Stage({"web": 1.0}), Stage({"code": 1.0}, start=1.5)], "data.stages[1].start: expected a fraction"),
    ([Stage({"web": 1.0}, start=3)], "data.stages[0].start: expected the first stage to start at step 0"),
    ([Stage({"web": 1.0}), Stage({"code": 1.0}, start=5), Stage({"books": 1.0}, start=5)], "data.stages[2].start"),
])
def test_bad_stages_name_the_key_path(stages, needle):
    with pytest.raises(MixtureError) as e:
        account(stages, ROWS, tokens_per_row=1, rows_per_step=1, total_steps=20)
    assert needle in str(e.value)


def test_sources_of_another_tokenizer_or_seq_len_are_refused(tmp_path):
    import json as _json

    from apr.data.mixplan import check_compatible

    def source(name, seq_len, sha):
        (tmp_path / name / "train").mkdir(parents=True)
        (tmp_path / name / "manifest.json").write_text(_json.dumps({"seq_len": seq_len, "tokenizer": {"sha256": sha}}))
        return tmp_path / name / "train"

    a, b, c = source("a", 16, "x"), source("b", 16, "x"), source("c", 32, "x")
    d = source("d", 16, "y")
    check_compatible({"a": a, "b": b})
    with pytest.raises(MixtureError, match=r"data.train\[2\] \(c, .*seq_len 32.*'a'.*seq_len 16"):
        check_compatible({"a": a, "b": b, "c": c})
    with pytest.raises(MixtureError, match=r"data.train\[1\] \(d, .*tokenizer 'y'"):
        check_compatible({"a": a, "d": d})
