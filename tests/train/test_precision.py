"""apr/train/precision.py: compute dtypes, autocast and fp16 dynamic loss scaling."""

from __future__ import annotations

import contextlib

import pytest
import torch

from apr.train.precision import DynamicLossScaler, autocast, torch_dtype


def test_each_precision_names_its_torch_dtype():
    assert [torch_dtype(p) for p in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]


def test_autocast_is_a_no_op_in_float32_and_casts_matmuls_otherwise():
    cpu = torch.device("cpu")
    assert isinstance(autocast(cpu, torch.float32), contextlib.nullcontext)
    a = torch.randn(4, 4)
    with autocast(cpu, torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16


def test_overflow_skips_the_step_and_halves_the_scale():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    s.update(found_inf=False)
    s.update(found_inf=True)
    assert (s.scale, s.good_steps, s.skipped_steps) == (512.0, 0, 1)


def test_the_scale_doubles_after_growth_interval_good_steps_in_a_row():
    s = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 1024.0
    s.update(found_inf=False)
    assert (s.scale, s.good_steps) == (2048.0, 0)


def test_disabled_scaler_keeps_a_scale_of_one():
    s = DynamicLossScaler(enabled=False)
    s.update(found_inf=True)
    assert (s.scale, s.skipped_steps) == (1.0, 0)


def test_a_scale_leaving_the_float_range_is_an_error():
    s = DynamicLossScaler(init_scale=1.0, backoff_factor=0.0)
    with pytest.raises(FloatingPointError, match="loss scale"):
        s.update(found_inf=True)


def test_state_round_trips_for_exact_resume():
    s = DynamicLossScaler(init_scale=256.0, growth_interval=5)
    for inf in (False, True, False, False):
        s.update(found_inf=inf)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.good_steps, t.skipped_steps) == (128.0, 2, 1)
