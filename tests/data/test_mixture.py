from collections import Counter

import pytest

from apr.data.mixture import MixtureCursor, MixtureError

W = {"web": 0.5, "code": 0.3, "books": 0.2}
ROWS = {"web": 7, "code": 5, "books": 3}


def test_counts_are_exact_at_every_prefix():
    m = MixtureCursor(W, ROWS, seed=3)
    seen = Counter()
    for k in range(1, 201):
        seen[m.next()[0]] += 1
        for name, w in W.items():
            assert abs(seen[name] - k * w) < 1.0 + 1e-9
    assert seen == Counter({"web": 100, "code": 60, "books": 40})


def test_cursor_walks_each_source_in_order_and_wraps():
    m = MixtureCursor(W, ROWS, seed=0)
    rows = [m.next() for _ in range(40)]
    books = [(e, r) for n, e, r in rows if n == "books"]
    assert books == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]


def test_resume_from_state_gives_the_same_rows():
    full = MixtureCursor(W, ROWS, seed=11)
    whole = [full.next() for _ in range(50)]
    a = MixtureCursor(W, ROWS, seed=11)
    first = [a.next() for _ in range(17)]
    b = MixtureCursor.from_state(W, ROWS, a.state())
    assert first + [b.next() for _ in range(33)] == whole


@pytest.mark.parametrize("weights", [{"a": -1.0, "b": 1.0}, {"a": 0, "b": 0}, {}, {"zzz": 1.0}])
def test_bad_weights_are_refused(weights):
    with pytest.raises(MixtureError):
        MixtureCursor(weights, {"a": 3, "b": 3})
