"""The update between two checkpoints per layer: zero where nothing moved, the exact relative norm
where something did, and blocks present in one only listed (a stacking stage)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from apr.checkpoint.sources import open_source  # noqa: E402
from apr.inspect.updates import compare_weights  # noqa: E402
from tests.inspect.conftest import write  # noqa: E402


def test_relative_update_per_layer_and_added_blocks(weights_file, tmp_path):
    path, tensors = weights_file
    after = dict(tensors)
    delta = torch.full((16, 8), 0.01)
    after["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"] + delta
    after["model.layers.2.mlp.up_proj.weight"] = torch.zeros(16, 8)  # a block the second stage added
    after["model.norm.weight"] = torch.ones(4)  # another shape: listed, not compared
    u = compare_weights(open_source(path), open_source(write(tmp_path / "after.safetensors", after)))
    by_layer = {r.layer: r.stats for r in u.layers}
    assert by_layer["layers.0"]["relative_update"] == 0 and by_layer["layers.0"]["cosine"] == pytest.approx(1)
    before_l1 = tensors["model.layers.1.mlp.up_proj.weight"].double()
    assert by_layer["layers.1"]["update_norm"] == pytest.approx(float(delta.double().norm()))
    assert by_layer["layers.1"]["relative_update"] == pytest.approx(float(delta.double().norm() / before_l1.norm()))
    assert u.only_after == ["model.layers.2.mlp.up_proj.weight"] and u.only_before == []
    assert u.reshaped == [{"name": "model.norm.weight", "before": [8], "after": [4]}]
    assert "norm" not in by_layer
