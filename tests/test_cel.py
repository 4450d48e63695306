"""apr.cel: expressions are bounded before the CEL library sees them; macro variables are not metrics."""

from __future__ import annotations

import pytest

from apr.cel import MAX_EXPRESSION_CHARS, CelError, compile_expr, evaluate, free_variables


def test_deep_parentheses_are_refused_before_the_library_panics():
    with pytest.raises(CelError, match="nests 2,000 levels deep"):
        compile_expr("(" * 2_000 + "loss" + ")" * 2_000)
    with pytest.raises(CelError, match="characters"):
        compile_expr("(" * 100_000 + "loss" + ")" * 100_000)
    with pytest.raises(CelError, match="levels deep"):
        compile_expr("(" * 40 + "1" + ")" * 40)
    assert evaluate("(" * 10 + "loss > 1" + ")" * 10, {"loss": 2.0}) is True


def test_long_expressions_are_refused():
    long = " || ".join(["loss > 1"] * 1000)
    assert len(long) > MAX_EXPRESSION_CHARS
    with pytest.raises(CelError, match="characters"):
        compile_expr(long)


def test_macro_bound_variables_are_not_free():
    assert sorted(free_variables("[loss, grad_norm].exists(x, x > 10)")) == ["grad_norm", "loss"]
    assert sorted(free_variables("[loss].all(v, v < 3) && [lr].map(m, m * 2)[0] > 0")) == ["loss", "lr"]
    assert sorted(free_variables("[loss].filter(f, f > 1).size() > 0 || [1].exists_one(e, e > step)")) == \
        ["loss", "step"]
    assert "unknown_metric" in free_variables("[loss].exists(x, x > unknown_metric)")
