"""Small configs and token batches for the engine tests (tiny models, CPU, float32)."""

from __future__ import annotations

import copy

import torch

from apr.config.schema import AprConfig

TINY = {
    "model": {"architecture": {
        "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": 53, "max_position_embeddings": 16,
    }},
    "data": {"train": "unused/", "batch_size": 2, "seq_len": 12},
    "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "weight_decay": 0.1},
    "training": {"mixed_precision": "fp32", "device": "cpu", "kernels": "torch", "loss_chunk_size": 5,
                 "grad_clip": 0.3, "seed": 11, "log_interval": 1},
}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_config(**sections) -> AprConfig:
    """TINY with section overrides, e.g. make_config(training={"engine": "standard"})."""
    return AprConfig.model_validate(_merge(TINY, sections))


def batches(config: AprConfig, n: int, seed: int = 0) -> list[torch.Tensor]:
    """n micro-batches of random token ids ``[batch, seq_len + 1]``."""
    gen = torch.Generator().manual_seed(seed)
    b, s = config.data.batch_size, config.data.seq_len
    v = config.model.architecture.vocab_size
    return [torch.randint(0, v, (b, s + 1), generator=gen) for _ in range(n)]
