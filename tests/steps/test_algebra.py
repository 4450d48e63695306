"""apr/steps/algebra.py: the step counts of a run, pure integer arithmetic."""

from __future__ import annotations

import pytest

from apr.steps.algebra import sequences_per_step, step_algebra, step_count


def algebra(num_sequences, *, batch=4, accum=2, world=3, epochs=3, max_steps=None, warmup=2, save=5, seq=16):
    return step_algebra(num_sequences=num_sequences, batch_size=batch, gradient_accumulation=accum,
                        world_size=world, epochs=epochs, max_steps=max_steps, warmup_steps=warmup,
                        save_interval=save, seq_len=seq)


def test_a_step_takes_batch_times_accumulation_times_ranks_and_the_remainder_is_dropped():
    s = algebra(100)  # 24 rows a step: 4 steps an epoch, 4 rows never fill a step
    assert (s.sequences_per_step, s.steps_per_epoch, s.dropped_sequences_per_epoch) == (24, 4, 4)
    assert (s.epoch_steps, s.total_steps, s.epochs_run) == (12, 12, 3.0)
    assert (s.tokens_per_step, s.total_tokens) == (24 * 16, 12 * 24 * 16)
    assert (s.checkpoints, s.warmup_fraction) == (2, 2 / 12)
    assert s.epochs_needed is None and s.sequences_needed is None  # only asked with max_steps


def test_max_steps_caps_the_run_inside_an_epoch():
    s = algebra(100, max_steps=5)
    assert (s.total_steps, s.epochs_run, s.total_tokens) == (5, 1.25, 5 * 24 * 16)
    assert s.epochs_needed == 2  # ceil(5 / 4)
    assert algebra(100, max_steps=50).total_steps == 12  # the data runs out first


@pytest.mark.parametrize("max_steps,epochs", [(5, 3), (7, 1), (12, 4), (1, 2), (30, 7)])
def test_sequences_and_epochs_needed_are_the_smallest_that_give_max_steps(max_steps, epochs):
    need = algebra(100, max_steps=max_steps, epochs=epochs).sequences_needed
    assert algebra(need, max_steps=max_steps, epochs=epochs).total_steps == max_steps
    assert algebra(need - 1, max_steps=max_steps, epochs=epochs).total_steps < max_steps
    e = algebra(100, max_steps=max_steps, epochs=epochs).epochs_needed
    assert algebra(100, max_steps=max_steps, epochs=e).total_steps == max_steps
    assert e == 1 or algebra(100, max_steps=max_steps, epochs=e - 1).total_steps < max_steps


def test_less_data_than_one_step_gives_no_steps_without_dividing_by_zero():
    s = algebra(23, max_steps=10)
    assert (s.steps_per_epoch, s.total_steps, s.epochs_run, s.checkpoints) == (0, 0, 0.0, 0)
    assert s.epochs_needed is None and s.sequences_needed == 4 * 24  # ceil(10 / 3) steps an epoch
    assert s.warmup_fraction == 2.0  # warmup over a run of (at least) one step


def test_to_dict_holds_every_fact():
    d = algebra(100, max_steps=5).to_dict()
    assert d["total_steps"] == 5 and d["sequences_per_step"] == 24 and d["max_steps"] == 5
    assert len(d) == 16


def test_step_count_defaults_to_one_epoch_on_one_rank_without_accumulation():
    c = step_count(num_sequences=103, batch_size=4)
    assert (c.sequences_per_step, c.steps_per_epoch, c.epoch_steps, c.total_steps) == (4, 25, 25, 25)
    assert c.dropped_sequences_per_epoch == 3
    assert sequences_per_step(4, 2, 3) == 24


@pytest.mark.parametrize("rows,batch,accum,world,epochs,max_steps", [
    (100, 4, 2, 3, 3, None), (100, 4, 2, 3, 3, 5), (23, 4, 2, 3, 1, 10), (67_977, 4, 1, 1, 38, 5000)])
def test_the_plans_facts_are_the_step_count(rows, batch, accum, world, epochs, max_steps):
    c = step_count(num_sequences=rows, batch_size=batch, gradient_accumulation=accum, world_size=world,
                   epochs=epochs, max_steps=max_steps)
    s = algebra(rows, batch=batch, accum=accum, world=world, epochs=epochs, max_steps=max_steps)
    assert (s.sequences_per_step, s.steps_per_epoch, s.epoch_steps, s.total_steps,
            s.dropped_sequences_per_epoch) == (c.sequences_per_step, c.steps_per_epoch, c.epoch_steps,
                                               c.total_steps, c.dropped_sequences_per_epoch)
