"""Per-layer weight and gradient histograms (monitoring.histograms): fixed bins per layer, every layer's
weights and gradient at the interval, the latest in the state file and each one in the stores."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from apr.apply import run_apply
from apr.track import store
from apr.train.histograms import LayerHistograms
from tests.train.run_helpers import make_dataset, write_config


def test_a_layers_bins_are_fixed_by_its_first_histogram_and_later_values_beyond_land_in_the_end_bins():
    hist = LayerHistograms(interval=1, bins=4)
    hist._add("weight", "block.0", [torch.tensor([-2.0, -1.0, 0.5, 2.0]), torch.tensor([1.5])])
    counts, span, stride = hist._pending[("weight", "block.0")]
    assert stride == 1 and hist.edges[("weight", "block.0")] == 2.0 and counts.tolist() == [1, 1, 1, 2]
    assert span.tolist() == [-2.0, 2.0]
    hist._add("weight", "block.0", [torch.tensor([-9.0, 0.1, 7.0])])  # beyond the edges: the end bins
    counts, span, _ = hist._pending[("weight", "block.0")]
    assert hist.edges[("weight", "block.0")] == 2.0 and counts.tolist() == [1, 0, 1, 1]
    assert span.tolist() == [-9.0, 7.0]  # the true range is kept beside the fixed bins


def test_a_large_layer_is_counted_on_a_strided_sample_whose_shape_matches_the_whole(monkeypatch):
    from apr.train import histograms

    monkeypatch.setattr(histograms, "SAMPLE", 1000)
    values = torch.randn(64, 250, generator=torch.Generator().manual_seed(0))  # 16,000 elements
    hist = LayerHistograms(interval=1, bins=8)
    hist._add("weight", "embed", [values])
    counts, span, stride = hist._pending[("weight", "embed")]
    assert stride == 17  # the smallest prime >= 16: the sample does not repeat the same columns
    whole = torch.histc(values, bins=8, min=-float(span.abs().max()), max=float(span.abs().max()))
    assert counts.sum() == len(values.reshape(-1)[::17]) and span.tolist() == [values.min(), values.max()]
    assert (counts / counts.sum() - whole / whole.sum()).abs().max() < 0.03


@pytest.mark.parametrize("engine", ["interleaved", "standard"])
def test_a_run_records_every_layers_weight_and_gradient_histograms(tmp_path, monkeypatch, engine):
    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 8, "eval_interval": 0, "engine": engine},
                       monitoring={"histograms": {"interval": 4, "bins": 8}})
    assert run_apply(cfg, echo=lambda line: None).status == "finished"
    latest = json.loads((tmp_path / "run" / "training_state.json").read_text())["histograms"]
    assert latest["step"] == 8 and latest["bins"] == 8
    layers = {(h["kind"], h["name"]): h for h in latest["layers"]}
    names = ["embed", "block.0", "block.1", "head"]
    assert set(layers) == {(kind, name) for kind in ("weight", "grad") for name in names}
    numel = {"embed": 61 * 32, "head": 61 * 32 + 32}  # the head group holds the final norm too
    for (kind, name), h in layers.items():
        assert len(h["counts"]) == 8 and h["lo"] == -h["hi"] and h["min"] <= h["max"]
        if name in numel:
            assert sum(h["counts"]) == numel[name]
        assert kind == "weight" or h["max"] != 0.0  # a real gradient, not an empty buffer
    conn = sqlite3.connect(tmp_path / "run" / ".apr" / "experiments.db")
    conn.row_factory = sqlite3.Row
    run_id = conn.execute("SELECT id FROM runs").fetchone()[0]
    records = store.histograms(conn, run_id)
    assert [r["step"] for r in records] == [4, 8] and records[1] == latest
    first = {(h["kind"], h["name"]): h["hi"] for h in records[0]["layers"]}
    assert first == {k: h["hi"] for k, h in layers.items()}  # bins fixed per layer
    assert all(e["kind"] != "histograms" for e in store.events(conn, run_id))
