"""Issue 16 item 4: MFU and HFU are quoted against a cited per-dtype peak, and an unknown GPU or
dtype is "MFU unknown" (text) / ``known: false`` with a reason (--json), never a fallback number."""

from __future__ import annotations

import json

import pytest

from apr.model.spec import flops_per_token
from apr.plan.build import build_plan
from apr.plan.examples import materialize
from apr.plan.gpus import CATALOGUE, DTYPES, from_device_name, lookup
from apr.plan.render import render_json, render_text


def _plan(tmp_path, config=None, **target):
    cfg, kw = materialize({"config": config or {}, "target": target}, tmp_path / "run")
    return build_plan(cfg, **kw)


def test_every_catalogue_card_cites_a_source_and_only_known_dtypes():
    for gpu in CATALOGUE.values():
        assert gpu.source.startswith("NVIDIA ") and gpu.tflops
        assert all(d in DTYPES and v > 0 for d, v in gpu.tflops)
    assert lookup("h100").peak_tflops("bf16") == 989.4 and lookup("a100").peak_tflops("tf32") == 156.0
    assert lookup("t4").peak_flops("bf16") is None and lookup("t4").peak_flops("fp16") == 65e12


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("NVIDIA GeForce RTX 4090", "4090"), ("Tesla T4", "t4"),
    ("NVIDIA H200", "h200"), ("NVIDIA L40S", "l40s"),
    ("NVIDIA H100 NVL", None), ("NVIDIA A10G", None), ("NVIDIA L40", None), ("NVIDIA GeForce RTX 3090 Ti", None),
    ("Tesla V100-PCIE-16GB", None), ("AMD Instinct MI300X", None),
])
def test_device_names_map_to_a_card_or_to_nothing(name, key):
    gpu = from_device_name(name)
    assert (gpu.name if gpu else None) == key


def test_a_known_gpu_quotes_mfu_and_hfu_against_its_dtype_peak(tmp_path):
    plan = _plan(tmp_path, {"training": {"mixed_precision": "fp16"}}, gpu="a100")
    mfu = plan.to_dict()["mfu"]
    arch = plan.config.model.architecture
    assert mfu["known"] and mfu["dtype"] == "fp16" and mfu["peak_flops"] == 312e12
    assert mfu["model_flops_per_token"] == flops_per_token(arch, 32)
    assert mfu["hardware_flops_per_token"] == pytest.approx(mfu["model_flops_per_token"] * mfu["execution_cost_f"] / 3)
    assert mfu["assumed_hfu"] == pytest.approx(0.40 * mfu["execution_cost_f"] / 3)
    text = render_text(plan)
    assert "peak 312.0 TFLOP/s fp16 dense (NVIDIA A100 Tensor Core GPU datasheet)" in text


def test_recompute_makes_hfu_exceed_mfu(tmp_path):
    plan = _plan(tmp_path, {"training": {"execution": {"activations": "recompute", "gradients": "kept"}}}, gpu="h100")
    mfu = plan.facts["mfu"]
    assert mfu["execution_cost_f"] == 4.0 and mfu["hfu_per_mfu"] == pytest.approx(4 / 3)
    assert mfu["assumed_hfu"] > mfu["assumed_mfu"]


def test_a_dtype_the_card_lacks_is_mfu_unknown_with_no_time_estimate(tmp_path):
    plan = _plan(tmp_path, {"training": {"mixed_precision": "bf16"}}, gpu="t4")
    doc = json.loads(render_json(plan))
    assert doc["mfu"]["known"] is False and "no bf16 peak" in doc["mfu"]["reason"]
    assert "peak_flops" not in doc["mfu"] and "assumed_mfu" not in doc["mfu"]
    assert doc["time_estimate"] is None  # was: an estimate at the fp16 peak
    assert "not estimated: MFU unknown: NVIDIA T4 16GB has no bf16 peak" in render_text(plan)


def test_no_gpu_is_mfu_unknown(tmp_path):
    plan = _plan(tmp_path, {"training": {"device": "cuda"}})
    assert plan.facts["mfu"]["known"] is False and "no GPU is named" in plan.facts["mfu"]["reason"]
    assert "MFU unknown" in render_text(plan)
