"""Tiny configs and synthetic train states for the checkpoint tests (no trainer needed)."""

from __future__ import annotations

import pytest

TINY = {
    "model": {"architecture": {
        "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 24, "vocab_size": 40, "max_position_embeddings": 32,
    }},
    "data": {"train": "data/train/", "batch_size": 2, "seq_len": 8},
    "training": {"keep_last": 1, "mixed_precision": "fp32", "device": "cpu"},
}


def make_config(**overrides):
    """A tiny AprConfig; ``overrides`` are dotted paths, e.g. ``{"training.seed": 7}``."""
    import copy

    from apr.config.schema import AprConfig

    doc = copy.deepcopy(TINY)
    for path, value in overrides.items():
        node = doc
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return AprConfig.model_validate(doc)


def make_tensors(config, seed: int = 0) -> dict:
    """Random float32 weights and AdamW m/v with the model's Hugging Face names and shapes."""
    import torch

    from apr.model.spec import param_specs

    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in param_specs(config.model.architecture):
        out[p.name] = torch.randn(p.shape, generator=g)
        out["optimizer.m." + p.name] = torch.randn(p.shape, generator=g) * 1e-3
        out["optimizer.v." + p.name] = torch.rand(p.shape, generator=g) * 1e-6
    return out


@pytest.fixture
def tiny_config():
    return make_config()
