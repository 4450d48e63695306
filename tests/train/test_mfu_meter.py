"""Measured MFU/HFU (issue 16 item 4): only on a GPU the peak table names, against its dtype's peak;
anything else is "MFU unknown", never a fallback number."""

from __future__ import annotations

import pytest
import torch
from tiny import make_config

from apr.model.spec import flops_per_token
from apr.steps.execution import parse
from apr.train import mfu


def test_a_cpu_run_has_no_mfu():
    meter, line = mfu.mfu_meter(make_config(), torch.device("cpu"), parse("keep", "kept", 2), 1)
    assert meter is None and line.startswith("MFU unknown: the device is cpu")


def test_a_catalogue_gpu_quotes_its_dtype_peak_and_hfu_counts_recompute(monkeypatch):
    monkeypatch.setattr(mfu.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    config = make_config(training={"mixed_precision": "bf16"})
    meter, line = mfu.mfu_meter(config, torch.device("cuda", 0), parse("recompute", "kept", 2), 4)
    assert "989.4 TFLOP/s bf16 dense x 4 GPUs" in line and "NVIDIA H100 Tensor Core GPU datasheet" in line
    f = flops_per_token(config.model.architecture, config.data.seq_len)
    got = meter(1e6)
    assert got["mfu"] == pytest.approx(1e6 * f / (989.4e12 * 4))
    assert got["hfu"] == pytest.approx(got["mfu"] * 4 / 3)  # full recompute: 4F per step against 3F
    assert meter(None) == {}


@pytest.mark.parametrize("name, precision, why", [
    ("NVIDIA H100 NVL", "bf16", "GPU 'NVIDIA H100 NVL' is not in the peak-FLOPs table"),
    ("Tesla T4", "bf16", "NVIDIA T4 16GB has no bf16 peak in the table"),
])
def test_an_unknown_card_or_dtype_is_mfu_unknown(monkeypatch, name, precision, why):
    monkeypatch.setattr(mfu.torch.cuda, "get_device_name", lambda device: name)
    config = make_config(training={"mixed_precision": precision})
    meter, line = mfu.mfu_meter(config, torch.device("cuda", 0), parse("keep", "kept", 2), 1)
    assert meter is None and line.startswith(f"MFU unknown: {why}")


def test_the_log_step_records_mfu_and_hfu_beside_tokens_per_s():
    from apr.track.protocol import NullRecorder
    from apr.train.engine import StepResult
    from apr.train.steplog import StepLog

    log = StepLog(total_steps=100, tokens_per_step=4096, dp=None, echo=lambda line: None, label=str)
    log.mfu = mfu.MfuMeter(flops_per_token=10**9, hfu_per_mfu=1.5, peak_flops=1e15)
    log.start(0)
    metrics = log.log(10, 3e-4, StepResult(torch.tensor(2.5), torch.tensor(0.75)), 0.4, NullRecorder(None))
    assert metrics["mfu"] == pytest.approx(metrics["tokens_per_s"] * 1e9 / 1e15)
    assert metrics["hfu"] == pytest.approx(metrics["mfu"] * 1.5)
