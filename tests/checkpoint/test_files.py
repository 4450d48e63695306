import json
import math
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from apr.checkpoint import files


def test_streamed_safetensors_loads_with_the_official_reader(tmp_path):
    tensors = {
        "b.weight": torch.randn(3, 5),
        "a.bias": torch.arange(7, dtype=torch.int64),
        "half": torch.randn(4, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "view": torch.randn(6, 4)[:, 1],  # non-contiguous
    }
    path = tmp_path / "x.safetensors"
    sha, size = files.write_safetensors(path, tensors, metadata={"step": 3})
    assert (sha, size) == files.sha256_file(path)
    assert size == path.stat().st_size
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name], t.contiguous()), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "3"}
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0
    assert files.read_safetensors_header(path)["b.weight"]["shape"] == [3, 5]


def test_write_is_atomic_and_leaves_no_temp_on_error(tmp_path):
    path = tmp_path / "x.safetensors"
    files.write_safetensors(path, {"a": torch.ones(2)})
    before = path.read_bytes()
    with pytest.raises(ValueError, match="dtype"):
        files.write_safetensors(path, {"a": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_same_tensors_give_the_same_bytes(tmp_path):
    t = {"w": torch.randn(4, 4), "v": torch.randn(2)}
    a = files.write_safetensors(tmp_path / "a.safetensors", t)
    b = files.write_safetensors(tmp_path / "b.safetensors", dict(reversed(list(t.items()))))
    assert a == b


def test_non_finite_floats_round_trip_through_strict_json():
    meta = {"best_val_loss": math.inf, "x": [-math.inf, 1.5, {"y": math.nan}], "n": 3}
    text = json.dumps(files.encode_floats(meta), allow_nan=False)
    back = files.decode_floats(json.loads(text))
    assert back["best_val_loss"] == math.inf
    assert back["x"][0] == -math.inf and back["x"][1] == 1.5 and math.isnan(back["x"][2]["y"])
    assert back["n"] == 3


def test_link_or_copy_replaces_target(tmp_path):
    src, dst = tmp_path / "s", tmp_path / "d"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    files.link_or_copy(src, dst)
    assert dst.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "s"]
