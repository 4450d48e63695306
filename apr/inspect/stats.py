"""Per-tensor and per-layer weight statistics and histograms, streamed a slice of rows at a time.

Two passes per layer: the first gathers moments, extremes, zeros and non-finite counts of each
tensor; the second bins the layer's weight matrices over their common [min, max]. Norm weights
(1-d) get statistics but stay out of the layer's histogram: sitting near 1 while matrices sit near
0, they would squeeze the matrices into one bin.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from apr.checkpoint.sources import WeightSource

CHUNK_ELEMENTS = 1 << 22  # 4M elements (16 MiB as float32): the most one read holds
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``layers.3``; the embedding, final norm and head by name."""
    m = _LAYER.search(name)
    if m:
        return f"layers.{m.group(1)}"
    for key in ("embed_tokens", "lm_head"):
        if key in name:
            return key
    return "norm" if name.endswith("norm.weight") else name


def layer_order(layer: str) -> tuple:
    if layer == "embed_tokens":
        return (0, 0)
    if layer.startswith("layers."):
        return (1, int(layer.split(".")[1]))
    return (2, 0 if layer == "norm" else 1, layer)


def chunks(source: WeightSource, name: str):
    """The tensor as float32 slices of whole rows, each at most ``CHUNK_ELEMENTS`` (or one row)."""
    shape = source.shape(name)
    rows = shape[0] if shape else 1
    per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    for start in range(0, rows, step):
        yield source.rows(name, start, min(start + step, rows)).float().reshape(-1)


@dataclass
class Moments:
    count: int = 0  # finite elements
    total: float = 0.0
    squares: float = 0.0
    abs_total: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    zeros: int = 0
    nonfinite: int = 0

    def add(self, x: torch.Tensor) -> None:
        # float32 passes with float64 accumulators (sum(dtype=float64)): no float64 copy of the slice
        if not bool(torch.isfinite(x).all()):
            finite = torch.isfinite(x)
            self.nonfinite += int(x.numel() - finite.sum())
            x = x[finite]
        if x.numel() == 0:
            return
        self.count += x.numel()
        self.total += float(x.sum(dtype=torch.float64))
        self.squares += float((x * x).sum(dtype=torch.float64))
        self.abs_total += float(x.abs().sum(dtype=torch.float64))
        low, high = torch.aminmax(x)
        self.low, self.high = min(self.low, float(low)), max(self.high, float(high))
        self.zeros += x.numel() - int(torch.count_nonzero(x))

    def merge(self, other: Moments) -> None:
        for f in ("count", "total", "squares", "abs_total", "zeros", "nonfinite"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)

    def summary(self) -> dict:
        n = self.count
        mean = self.total / n if n else None
        var = max(self.squares / n - mean * mean, 0.0) if n else None
        return {"numel": n + self.nonfinite, "mean": mean, "std": math.sqrt(var) if n else None,
                "rms": math.sqrt(self.squares / n) if n else None, "abs_mean": self.abs_total / n if n else None,
                "min": self.low if n else None, "max": self.high if n else None,
                "zero_fraction": self.zeros / n if n else None, "nonfinite": self.nonfinite}


@dataclass
class TensorStats:
    name: str
    layer: str
    shape: tuple[int, ...]
    dtype: str
    stats: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "layer": self.layer, "shape": list(self.shape), "dtype": self.dtype, **self.stats}


@dataclass
class LayerStats:
    layer: str
    tensors: int
    stats: dict  # over the layer's weight matrices (every tensor where it has none)
    bin_edges: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "tensors": self.tensors, **self.stats,
                "histogram": {"edges": self.bin_edges, "counts": self.counts}}


def _histogram(source: WeightSource, names: list[str], low: float, high: float, bins: int) -> list[int]:
    counts = torch.zeros(bins, dtype=torch.float64)
    if not high > low:  # a constant layer: everything in the middle bin
        high, low = low + 0.5, low - 0.5
    for name in names:
        for x in chunks(source, name):
            if not bool(torch.isfinite(x).all()):
                x = x[torch.isfinite(x)]
            counts += torch.histc(x, bins=bins, min=low, max=high).double()
    return [int(c) for c in counts.tolist()]


def weight_stats(source: WeightSource, bins: int = 40,
                 select=lambda name: True) -> tuple[list[LayerStats], list[TensorStats]]:
    """Statistics of every tensor ``select`` keeps, grouped by layer in model order, each layer
    with a histogram of ``bins`` bins over its weight matrices."""
    by_layer: dict[str, list[str]] = {}
    for name in source.names:
        if select(name):
            by_layer.setdefault(layer_of(name), []).append(name)
    layers, tensors = [], []
    for layer in sorted(by_layer, key=layer_order):
        names = by_layer[layer]
        matrices = [n for n in names if len(source.shape(n)) >= 2] or names
        combined = Moments()
        for name in names:
            m = Moments()
            for x in chunks(source, name):
                m.add(x)
            tensors.append(TensorStats(name, layer, source.shape(name), source.dtype(name), m.summary()))
            if name in matrices:
                combined.merge(m)
        row = LayerStats(layer, len(names), combined.summary())
        if combined.count:
            counts = _histogram(source, matrices, combined.low, combined.high, bins)
            width = (combined.high - combined.low) / bins if combined.high > combined.low else 1.0 / bins
            low = combined.low if combined.high > combined.low else combined.low - 0.5
            row.bin_edges = [low + i * width for i in range(bins + 1)]
            row.counts = counts
        layers.append(row)
    return layers, tensors
