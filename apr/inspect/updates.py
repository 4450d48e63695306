"""How much each layer moved between two checkpoints (before/after distillation, a stacking stage,
a LoRA merge, two steps of a run), streamed a slice of rows at a time from both.

Per tensor: the update's norm ``||B - A||``, relative to ``||A||``, and the cosine between A and B.
Per layer the same over all its tensors together. Tensors in one checkpoint only (stacking adds
blocks) or with another shape are listed, not compared.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from apr.checkpoint.sources import WeightSource
from apr.inspect.stats import chunks, layer_of, layer_order


@dataclass
class Sums:
    diff: float = 0.0  # sum (b - a)^2
    before: float = 0.0  # sum a^2
    after: float = 0.0  # sum b^2
    dot: float = 0.0  # sum a * b
    nonfinite: int = 0  # positions where A or B is inf or NaN: left out of the sums, counted here

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        a, b = a.double(), b.double()
        both = torch.isfinite(a) & torch.isfinite(b)
        if not bool(both.all()):
            self.nonfinite += int(both.numel() - both.sum())
            a, b = a[both], b[both]
        self.diff += float(((b - a) ** 2).sum())
        self.before += float((a * a).sum())
        self.after += float((b * b).sum())
        self.dot += float((a * b).sum())

    def merge(self, other: Sums) -> None:
        self.diff += other.diff
        self.before += other.before
        self.after += other.after
        self.dot += other.dot
        self.nonfinite += other.nonfinite

    def summary(self) -> dict:
        norm = math.sqrt(self.diff)
        return {"update_norm": norm, "before_norm": math.sqrt(self.before), "after_norm": math.sqrt(self.after),
                "relative_update": norm / math.sqrt(self.before) if self.before > 0 else None,
                "cosine": (self.dot / math.sqrt(self.before * self.after)
                           if self.before > 0 and self.after > 0 else None), "nonfinite": self.nonfinite}


@dataclass
class UpdateRow:
    name: str  # a tensor or a layer
    layer: str
    stats: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "layer": self.layer, **self.stats}


@dataclass
class Updates:
    layers: list[UpdateRow]
    tensors: list[UpdateRow]
    only_before: list[str] = field(default_factory=list)
    only_after: list[str] = field(default_factory=list)
    reshaped: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["layers"] = [r.to_dict() for r in self.layers]
        doc["tensors"] = [r.to_dict() for r in self.tensors]
        return doc


def _tensor_sums(a: WeightSource, b: WeightSource, name: str) -> Sums:
    sums = Sums()
    for x, y in zip(chunks(a, name), chunks(b, name), strict=True):  # same shape: the same row slices
        sums.add(x, y)
    return sums


def compare_weights(before: WeightSource, after: WeightSource, select=lambda name: True) -> Updates:
    names_a = {n for n in before.names if select(n)}
    names_b = {n for n in after.names if select(n)}
    common = sorted(names_a & names_b, key=lambda n: (layer_order(layer_of(n)), n))
    out = Updates([], [], only_before=sorted(names_a - names_b), only_after=sorted(names_b - names_a))
    by_layer: dict[str, Sums] = {}
    for name in common:
        if before.shape(name) != after.shape(name):
            out.reshaped.append({"name": name, "before": list(before.shape(name)), "after": list(after.shape(name))})
            continue
        sums = _tensor_sums(before, after, name)
        layer = layer_of(name)
        by_layer.setdefault(layer, Sums()).merge(sums)
        out.tensors.append(UpdateRow(name, layer, sums.summary()))
    out.layers = [UpdateRow(layer, layer, by_layer[layer].summary()) for layer in sorted(by_layer, key=layer_order)]
    return out
