"""The shipped continued-pretraining and LoRA configs validate, and their plan's memory rows are the
ones docs/finetuning.md quotes (the LoRA config keeps no moments or gradients for the base)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from apr.config import load_config
from apr.memory.buffers import buffer_plan
from apr.model.spec import param_count, trainable_param_count
from apr.plan.validate import config_findings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["continue-350m.yaml", "lora-350m.yaml"])
def test_shipped_finetuning_configs_validate(name):
    loaded = load_config(REPO / "configs" / "train" / name)
    assert loaded.config.model.init_from is not None
    assert [f for f in config_findings(loaded) if f.severity == "error"] == []


def _by_component(config) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in buffer_plan(config):
        out[b.component] = out.get(b.component, 0) + b.nbytes
    return out


def test_lora_350m_trains_a_small_fraction_and_the_doc_quotes_its_numbers():
    full = load_config(REPO / "configs" / "train" / "continue-350m.yaml").config
    lora = load_config(REPO / "configs" / "train" / "lora-350m.yaml").config
    arch = lora.model.architecture
    # rank 16 on all seven projections: 24 x 16 x (sum of in + out) = 24 x 16 x 22,016
    assert trainable_param_count(lora) == 24 * 16 * (3 * (1024 + 4096) + 2 * (1024 + 1024) + 2 * (1024 + 256))
    assert trainable_param_count(lora) / param_count(arch) < 0.03
    f, lo = _by_component(full), _by_component(lora)
    assert lo["adamw_m"] == 4 * trainable_param_count(lora) and f["adamw_m"] == 4 * param_count(arch)
    assert lo["frozen_weights"] == f["weights"]
    doc = (REPO / "docs" / "finetuning.md").read_text()
    mib = f"{lo['adamw_m'] / 2**20:.2f} MiB"
    assert re.search(rf"\| adamw_m \| 1\.61 GiB \| {re.escape(mib)} \|", doc), mib
