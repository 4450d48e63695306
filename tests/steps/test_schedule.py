"""apr/steps/schedule.py: warmup, peak, decay to exactly min_lr, for every scheduler."""

from __future__ import annotations

import pytest

from apr.config.schema import AprConfig
from apr.steps.schedule import KINDS, LRSchedule, lr_at

DECAYING = ("cosine", "linear", "wsd")
# (peak, min_lr, total_steps, warmup_steps): 1.0 -> 0.1 is the case that ended at 0.0999.. before
CASES = [(1.0, 0.1, 100, 10), (3e-4, 3e-5, 5000, 500), (6e-4, 0.0, 37, 0), (1e-3, 1e-4, 2, 1), (0.7, 0.3, 11, 3)]


def schedule(kind, peak, min_lr, total, warmup, decay_fraction=0.2):
    return [lr_at(k, peak=peak, min_lr=min_lr, total_steps=total, warmup_steps=warmup, kind=kind,
                  decay_fraction=decay_fraction) for k in range(1, total + 1)]


@pytest.mark.parametrize("kind", DECAYING)
@pytest.mark.parametrize("peak,min_lr,total,warmup", CASES)
def test_decay_ends_at_exactly_min_lr_on_the_last_step(kind, peak, min_lr, total, warmup):
    assert schedule(kind, peak, min_lr, total, warmup)[-1] == min_lr


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("peak,min_lr,total,warmup", [c for c in CASES if c[3] > 0])
def test_warmup_starts_at_one_step_of_the_ramp_and_reaches_exactly_the_peak(kind, peak, min_lr, total, warmup):
    lrs = schedule(kind, peak, min_lr, total, warmup)
    assert lrs[0] == pytest.approx(peak / warmup, rel=1e-12)
    assert lrs[warmup - 1] == peak
    ramp = lrs[:warmup]
    assert all(a < b for a, b in zip(ramp, ramp[1:], strict=False))


@pytest.mark.parametrize("kind", DECAYING)
@pytest.mark.parametrize("peak,min_lr,total,warmup", CASES)
def test_decay_is_monotonic_and_stays_between_min_lr_and_peak(kind, peak, min_lr, total, warmup):
    decay = schedule(kind, peak, min_lr, total, warmup)[warmup:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert all(min_lr <= lr <= peak for lr in decay)


def test_constant_holds_the_peak_after_warmup_and_ignores_min_lr():
    lrs = schedule("constant", 1e-3, 1e-4, 50, 5)
    assert lrs[4:] == [1e-3] * 46


def test_cosine_and_linear_are_halfway_at_the_middle_of_the_decay():
    # warmup 10, total 110: the decay's middle (p = 1/2) is step 60
    for kind in ("cosine", "linear"):
        assert schedule(kind, 1.0, 0.2, 110, 10)[59] == pytest.approx(0.6, abs=1e-12)


def test_wsd_is_stable_until_the_last_decay_fraction_of_the_run():
    lrs = schedule("wsd", 1.0, 0.1, 100, 10, decay_fraction=0.2)
    assert lrs[9:80] == [1.0] * 71  # steps 10..80 at the peak
    assert lrs[80] < 1.0  # step 81 starts the 20-step decay
    assert lrs[-1] == 0.1
    assert schedule("wsd", 1.0, 0.1, 100, 10, decay_fraction=1.0)[10] < 1.0  # decay longer than the run after warmup


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="from 1"):
        lr_at(0, peak=1.0, min_lr=0.1, total_steps=10, warmup_steps=0, kind="cosine")
    with pytest.raises(ValueError, match="unknown lr_scheduler"):
        lr_at(1, peak=1.0, min_lr=0.1, total_steps=10, warmup_steps=0, kind="step")


def test_from_config_uses_the_default_min_lr_of_ten_percent():
    config = AprConfig.model_validate({
        "model": {"architecture": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                                   "intermediate_size": 64, "vocab_size": 50, "max_position_embeddings": 16}},
        "data": {"train": "d/", "batch_size": 1, "seq_len": 8},
        "optimizer": {"lr": 1.0},
        "training": {"warmup_steps": 3, "lr_scheduler": "linear"},
    })
    sched = LRSchedule.from_config(config, total_steps=20)
    assert (sched.peak, sched.min_lr, sched.warmup_steps, sched.kind) == (1.0, 0.1, 3, "linear")
    assert sched(3) == 1.0 and sched(20) == 0.1
