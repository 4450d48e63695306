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


W = "model.layers.0.mlp.up_proj.weight"


def _hostile(path, header, body=b"", length=None):
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head) if length is None else length) + head + body)
    return path


HOSTILE_HEADERS = {
    "length past the file": (b"{}", b"", 90 << 20, "header cut short"),
    "absurd length": (b"{}", b"", 2**63, "not plausible"),
    "shape product overflows": ({W: {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}, b"\0" * 16,
                                None, "more than the file holds"),
    "shape of 200,000 dims": ({W: {"dtype": "F32", "shape": [1] * 200_000, "data_offsets": [0, 4]}}, b"\0" * 4,
                              None, "at most 8"),
    "negative dim": ({W: {"dtype": "F32", "shape": [-4, -1], "data_offsets": [0, 16]}}, b"\0" * 16, None,
                     "non-negative"),
    "offsets past the file": ({W: {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**60]}}, b"\0" * 16, None,
                              "inside the file"),
    "unknown dtype": ({W: {"dtype": "X" * 100_000, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
                      "unknown dtype 'XXXXXXXXXXXXXXXXXXXX'"),
    "a megabyte name": ({"x" * 1_000_000: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None,
                        "longer than 1024"),
    "a million empty lists": (b'{"a":[' + b"[]," * 1_000_000 + b"[]]}", b"", None, "more than 100000 tensors"),
    "nested 200,000 deep": (b"[" * 200_000 + b"]" * 200_000, b"", None, "nests too deeply"),
    "metadata not strings": ({"__metadata__": {"format": ["x"] * 10}}, b"", None, "__metadata__"),
}


@pytest.mark.parametrize("case", list(HOSTILE_HEADERS))
def test_a_hostile_header_is_refused_before_anything_is_allocated_from_it(tmp_path, case):
    header, body, length, needle = HOSTILE_HEADERS[case]
    path = _hostile(tmp_path / "w.safetensors", header, body, length)
    with pytest.raises(ValueError) as err:
        files.read_safetensors_header(path)
    assert needle in str(err.value) and len(str(err.value)) < 300


def test_every_hostile_header_is_an_inspect_error_not_a_traceback(tmp_path):
    from typer.testing import CliRunner

    from apr.cli.main import app

    for k, (header, body, length, _) in enumerate(HOSTILE_HEADERS.values()):
        path = _hostile(tmp_path / f"w{k}.safetensors", header, body, length)
        r = CliRunner().invoke(app, ["inspect", str(path)])
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert "source.bad_weights" in r.stderr and f"w{k}.safetensors" in r.stderr and len(r.stderr) < 2000


def test_a_real_header_passes_the_checks(tmp_path):
    tensors = {"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16), "c": torch.zeros(0, 5),
               "d": torch.tensor(1.0)}
    sha, size = files.write_safetensors(tmp_path / "ok.safetensors", tensors, metadata={"step": "3"})
    header = files.read_safetensors_header(tmp_path / "ok.safetensors")
    assert header["a"]["shape"] == [3, 4] and header["__metadata__"] == {"step": "3"}


def test_a_fifo_under_a_weights_name_is_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        files.read_safetensors_header(fifo)
