"""Helpers shared by the run-record tests and the subprocesses they start (no pytest import)."""

from __future__ import annotations

from apr.config.schema import AprConfig


def make_config(**sections) -> AprConfig:
    doc = {
        "model": {
            "architecture": {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 256,
                "max_position_embeddings": 64,
            }
        },
        "data": {"train": "data/train", "batch_size": 2, "seq_len": 32},
        "training": {"log_interval": 1},
        "monitoring": {"system": {"enabled": False}},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return AprConfig.model_validate(doc)
