"""The plan's figures beside a measured step: the same config asked with the standard engine, and
the model's FLOPs and activation figures close to what torch counts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from apr.config.schema import AprConfig, Architecture  # noqa: E402
from apr.model.llama import build_model  # noqa: E402
from apr.profile.compare import compare, plan_config  # noqa: E402
from apr.profile.step import profile_step  # noqa: E402

ARCH = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def step():
    arch = Architecture.model_validate(ARCH)
    return arch, profile_step(build_model(arch, seed=0), batch_size=2, seq_len=32, steps=1)


def test_plan_config_takes_the_measured_shape_engine_and_precision(step):
    arch, p = step
    cfg = AprConfig.model_validate({"model": {"architecture": ARCH},
                                    "data": {"train": "d/", "batch_size": 8, "seq_len": 64},
                                    "training": {"mixed_precision": "bf16"}})
    asked = plan_config(cfg, arch, p)
    assert (asked.data.batch_size, asked.data.seq_len) == (2, 32)
    assert str(asked.training.engine) == "standard" and str(asked.training.mixed_precision) == "fp32"
    assert str(asked.training.device) == "cpu"
    assert plan_config(None, arch, p).model.architecture == arch  # a Hugging Face folder has no config


def test_figures_are_close_to_the_measured_step(step):
    arch, p = step
    rows = {c.figure: c for c in compare(p, plan_config(None, arch, p))}
    assert set(rows) == {"flops_per_token", "weight_bytes", "block_saved_bytes"}  # no peak on the CPU
    assert rows["weight_bytes"].ratio == 1.0
    assert 0.85 < rows["flops_per_token"].ratio < 1.15
    assert 0.9 < rows["block_saved_bytes"].ratio < 1.1  # the plan's keep_* coefficients
    assert rows["flops_per_token"].to_dict()["ratio"] == round(rows["flops_per_token"].ratio, 4)
