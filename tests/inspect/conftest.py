from __future__ import annotations

import pytest


def write(path, tensors):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.fixture
def weights_file(tmp_path):
    """Two blocks and an embedding with known values, as a bare .safetensors file."""
    import torch

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(50, 8, generator=gen),
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=gen) * 0.02,
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.layers.1.mlp.up_proj.weight": torch.randn(16, 8, generator=gen) * 0.02,
        "model.norm.weight": torch.ones(8),
    }
    return write(tmp_path / "w.safetensors", tensors), tensors
