"""Cadence: which steps log, validate and save."""

from __future__ import annotations

from apr.train.cadence import Cadence


def _cadence(**kw) -> Cadence:
    base = {"total_steps": 10, "log_interval": 3, "eval_interval": 4, "save_interval": 5, "validates": True}
    return Cadence(**(base | kw))


def test_log_steps_are_the_interval_the_last_step_and_a_stopping_step():
    c = _cadence()
    assert [s for s in range(1, 11) if c.log(s, stopping=False)] == [3, 6, 9, 10]
    assert c.log(7, stopping=True)


def test_validation_needs_a_val_set_and_an_interval():
    assert [s for s in range(1, 11) if _cadence().validate(s)] == [4, 8, 10]
    assert not any(_cadence(validates=False).validate(s) for s in range(1, 11))
    assert not any(_cadence(eval_interval=0).validate(s) for s in range(1, 11))


def test_saves_at_the_interval_the_last_step_a_best_step_and_a_stopping_step():
    c = _cadence()
    assert [s for s in range(1, 11) if c.save(s, is_best=False, stopping=False)] == [5, 10]
    assert c.save(3, is_best=True, stopping=False) and c.save(3, is_best=False, stopping=True)
