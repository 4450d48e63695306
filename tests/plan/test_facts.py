"""The plan's time estimate counts the chosen execution's forward-equivalents."""

from __future__ import annotations

import pytest

from apr.plan.build import build_plan
from apr.plan.examples import materialize


def test_time_estimate_scales_with_the_execution_cost(tmp_path):
    lean = {"training": {"execution": {"activations": "recompute", "gradients": "workspace"}}}
    fast_cfg, _ = materialize({}, tmp_path / "fast")
    lean_cfg, _ = materialize({"config": lean}, tmp_path / "lean")
    fast, slow = build_plan(fast_cfg, gpu="h100"), build_plan(lean_cfg, gpu="h100")
    assert fast.time_estimate["execution_cost_f"] == 3.0 and slow.time_estimate["execution_cost_f"] == 7.0
    assert slow.time_estimate["total_flops"] == fast.time_estimate["total_flops"]  # model FLOPs (MFU's basis)
    ratio = slow.time_estimate["estimated_seconds"] / fast.time_estimate["estimated_seconds"]
    assert ratio == pytest.approx(7 / 3)
