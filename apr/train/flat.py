"""Per-group flat parameter buffers: each block's parameters are views into one float32 buffer,
with AdamW m and v beside it (docs/design.md, "The engines")."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from apr.kernels import DecayRanges
from apr.model.spec import ParamSpec


@dataclass
class FlatGroup:
    """One optimizer group ("embed", "block.i", "head") over a flat buffer."""

    name: str
    specs: list[ParamSpec]
    flat_params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: DecayRanges
    own_grad: torch.Tensor | None = None  # a dedicated gradient buffer; None: use the shared workspace
    compute: torch.Tensor | None = None  # the weights in the compute dtype, written by AdamW (param_copy)
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.flat_params.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (at least ``numel`` long) cut into this group's parameter shapes."""
        return [flat[o:o + s.numel].view(s.shape) for o, s in zip(self.offsets, self.specs, strict=True)]

    def bind_grads(self, buf: torch.Tensor) -> None:
        """Point every parameter's ``.grad`` at its slice of ``buf``: autograd then adds into it."""
        for p, g in zip(self.params, self.views(buf), strict=True):
            p.grad = g

    def release_grads(self) -> None:
        for p in self.params:
            p.grad = None


def flatten_group(
    model: nn.Module, name: str, specs: list[ParamSpec], flat: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
    own_grad: torch.Tensor | None = None,
) -> FlatGroup:
    """Copy the group's parameters into ``flat`` and re-point the model's parameters at views of it;
    zero the moments."""
    segments = [(s.numel, s.decay) for s in specs]
    group = FlatGroup(name, specs, flat, m, v, DecayRanges.from_segments(segments), own_grad)
    offset = 0
    for s in specs:
        group.offsets.append(offset)
        offset += s.numel
    if offset != flat.numel():
        raise ValueError(f"{name}: buffer holds {flat.numel()} elements, parameters {offset}")
    m.zero_()
    v.zero_()
    for s, view in zip(specs, group.views(flat), strict=True):
        module_name, _, leaf = s.name.rpartition(".")
        module = model.get_submodule(module_name)
        with torch.no_grad():
            view.copy_(getattr(module, leaf))
        param = nn.Parameter(view)  # shares the flat buffer's storage
        setattr(module, leaf, param)
        group.params.append(param)
    return group
