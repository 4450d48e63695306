"""The stacking trunk as StackWise stores it: earlier blocks frozen in their stage's precision
(fp32, fp16, bf16, or NF4 through torchao), optionally with LoRA adapters that train.

``apply_trunk`` transforms a freshly built model of one stage (``apr.steps.stacking.config_at``):
every trunk block's parameters stop requiring gradients, its projections are stored in their
precision (``FrozenLinear``) or carry adapters (``apr.model.lora.LoRALinear`` over the stored
weight). Checkpoints hold the trunk as float32 tensors (``trunk_state``): fp16/bf16 weights
widened exactly, NF4 weights as torchao's own parts, so a resumed run never quantizes again
(NF4 is not idempotent: quantizing a dequantized weight moves some codes). ``merged_weights``
turns a checkpoint's tensors into a plain model's (dequantized, adapters folded in) for export and
generation. See docs/design.md, "StackWise progressive stacks".
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from apr.config.schema import AprConfig
from apr.model import spec
from apr.model.lora import LoRALinear, peft_name
from apr.model.nf4 import dense, is_nf4, to_nf4
from apr.steps import stacking

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class FrozenLinear(nn.Module):
    """A trunk projection without adapters: its stored weight, read in the input's dtype."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not is_nf4(weight) and weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            weight = weight.to(x.dtype)
        return F.linear(x, weight)


class ProgressiveLoRALinear(LoRALinear):
    """A trunk projection with its adapter and the progressive adapters later grows added
    (``lora_A_s<k>``, ``lora_B_s<k>``): ``y = x W^T + sum over adapters of scaling * B(A(dropout(x)))``."""

    def __init__(self, weight: nn.Parameter, rank: int, scaling: float, dropout: float,
                 progressive: list[tuple[str, int, float]]):
        super().__init__(weight, rank, scaling, dropout)
        out_features, in_features = weight.shape
        self.progressive = [(sfx, scale) for sfx, _, scale in progressive]
        for sfx, r, _ in progressive:
            self.register_parameter(f"lora_A{sfx}", nn.Parameter(torch.zeros(r, in_features, device=weight.device)))
            self.register_parameter(f"lora_B{sfx}", nn.Parameter(torch.zeros(out_features, r, device=weight.device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        for sfx, scale in self.progressive:
            xa = F.dropout(x, self.dropout, self.training) if self.dropout else x
            y = y + F.linear(F.linear(xa, getattr(self, f"lora_A{sfx}")), getattr(self, f"lora_B{sfx}")) * scale
        return y


def _stored(weight: torch.Tensor, storage: str) -> torch.Tensor:
    return to_nf4(weight) if storage == "nf4" else weight.detach().to(DTYPES[storage])


@torch.no_grad()
def apply_trunk(model, config: AprConfig, seed: int) -> None:
    """Freeze the trunk blocks of ``config``'s stage, store their projections in their precision
    and put the trunk's adapters on them (``lora_A`` uniform in +-1/sqrt(in) from ``seed``, ``lora_B``
    zero, so the transformed model computes what the stored weights compute)."""
    trunk, adapters = stacking.trunk_storage(config), stacking.trunk_adapters(config)
    progressive, prog = stacking.progressive_stages(config), config.model.stacking.progressive_lora
    gen = torch.Generator(device="cpu").manual_seed(seed)
    targeted = set(adapters.modules) if adapters is not None else set()
    if stacking.embedding_frozen(config):
        model.model.embed_tokens.weight.requires_grad_(False)
    for i, storage in trunk.items():
        for p in model.model.layers[i].parameters():
            p.requires_grad_(False)
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            parent_name, _, leaf = spec.lora_module_path(i, m).rpartition(".")
            parent = model.get_submodule(parent_name)
            weight = nn.Parameter(_stored(getattr(parent, leaf).weight, storage), requires_grad=False)
            if m in targeted:
                extra = [(spec.progressive_suffix(k), prog.rank, prog.scaling) for k in progressive.get(i, ())]
                own = stacking.block_adapters(config, i)  # the rank and alpha of the stage that added block i
                layer = ProgressiveLoRALinear(weight, own.rank, own.scaling, own.dropout, extra)
                bound = 1.0 / math.sqrt(layer.lora_A.shape[1])
                for sfx in [""] + [e[0] for e in extra]:  # A uniform, B zero: every adapter starts at nothing
                    a = getattr(layer, f"lora_A{sfx}")
                    a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=gen))
            else:
                layer = FrozenLinear(weight)
            setattr(parent, leaf, layer)


def stored_tensors(name: str, weight: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """A trunk weight's checkpoint tensors (float32): ``name`` itself, or its NF4 parts. ``weight``
    may be stored already (a module's) or a float32 weight about to be stored (a grow)."""
    if storage != "nf4":
        return {name: dense(weight) if weight.dtype == DTYPES[storage] else dense(_stored(weight, storage))}
    q = weight if is_nf4(weight) else to_nf4(weight)
    return {f"{name}.nf4.{part}": getattr(q, part).detach().float().clone(memory_format=torch.contiguous_format)
            .reshape(spec.nf4_part_shapes(q.numel())[part]) for part in spec.NF4_PARTS}


def trunk_state(model, config: AprConfig) -> dict[str, torch.Tensor]:
    """The frozen trunk's tensors under checkpoint names (``spec.trunk_specs``)."""
    params = dict(model.named_parameters())
    out = {p.name: params[p.name].detach() for p in spec.embed_param_specs(config.model.architecture)
           if stacking.embedding_frozen(config)}
    for i, storage in stacking.trunk_storage(config).items():
        for p in spec.block_param_specs(config.model.architecture, i):
            out.update(stored_tensors(p.name, params[p.name], storage if p.decay else "fp32"))
    return out


@torch.no_grad()
def load_trunk_state(model, config: AprConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Set the trunk from checkpoint tensors: NF4 parts copied exactly, the rest cast to storage."""
    params = dict(model.named_parameters())
    if stacking.embedding_frozen(config):
        for p in spec.embed_param_specs(config.model.architecture):
            params[p.name].copy_(tensors[p.name])
    for i, storage in stacking.trunk_storage(config).items():
        for p in spec.block_param_specs(config.model.architecture, i):
            dst = params[p.name]
            if storage == "nf4" and p.decay:
                for part in spec.NF4_PARTS:
                    inner = getattr(dst, part)
                    inner.copy_(tensors[f"{p.name}.nf4.{part}"].to(inner.dtype).reshape(inner.shape))
            else:
                dst.copy_(tensors[p.name])


@torch.no_grad()
def base_weights(tensors: dict[str, torch.Tensor], config: AprConfig) -> dict[str, torch.Tensor]:
    """A stage's checkpoint tensors as a plain model's weights without the trunk's adapters
    (float32, HF names): NF4 parts dequantized, moments and adapters dropped. The base a PEFT
    export's adapters load onto."""
    arch = config.model.architecture
    out = {p.name: tensors[p.name] for p in spec.param_specs(arch) if p.name in tensors}
    for i, storage in stacking.trunk_storage(config).items():
        for p in spec.block_param_specs(arch, i):
            if storage == "nf4" and p.decay:
                template = to_nf4(torch.zeros(p.shape))  # the metadata of a weight this shape
                for part in spec.NF4_PARTS:
                    inner = getattr(template, part)
                    inner.copy_(tensors[f"{p.name}.nf4.{part}"].to(inner.dtype).reshape(inner.shape))
                out[p.name] = template.get_original_weight().float()
    return out


def _adapter_pairs(tensors: dict[str, torch.Tensor], config: AprConfig, i: int, m: str
                   ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Block ``i``'s adapters on projection ``m``: (A, B, scaling), its own first, then each
    progressive one in stage order."""
    adapters, prog = stacking.block_adapters(config, i), config.model.stacking.progressive_lora
    path = spec.lora_module_path(i, m)
    pairs = [(tensors[f"{path}.lora_A"].float(), tensors[f"{path}.lora_B"].float(), adapters.scaling)]
    for k in stacking.progressive_stages(config).get(i, ()):  # each later grow's adapter
        sfx = spec.progressive_suffix(k)
        pairs.append((tensors[f"{path}.lora_A{sfx}"].float(), tensors[f"{path}.lora_B{sfx}"].float(), prog.scaling))
    return pairs


@torch.no_grad()
def merged_weights(tensors: dict[str, torch.Tensor], config: AprConfig) -> dict[str, torch.Tensor]:
    """A stage's checkpoint tensors as a plain model's weights (float32, HF names): NF4 parts
    dequantized, every adapter folded in (``W + scaling * B @ A``), moments dropped."""
    out = base_weights(tensors, config)
    adapters = stacking.trunk_adapters(config)
    if adapters is None:
        return out
    for i in stacking.trunk_storage(config):
        for m in adapters.modules:
            name = f"{spec.lora_module_path(i, m)}.weight"
            for a, b, scaling in _adapter_pairs(tensors, config, i, m):
                out[name] = out[name].float() + (b @ a) * scaling
    return out


@torch.no_grad()
def peft_adapters(tensors: dict[str, torch.Tensor], config: AprConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """The trunk's adapters as one PEFT LoRA adapter per projection (PEFT's tensor names) and the
    adapter_config.json entries that differ from a plain LoRA run's (see docs/design.md section 31,
    "PEFT export"). A block with progressive adapters gets their concatenation, exactly their sum:
    ``sum_k s_k B_k A_k = s_1 [B_1, (s_2/s_1) B_2, ...] [A_1; A_2; ...]``, a rank ``r_1 + r_2 + ...``
    adapter with the first adapter's scaling (``rank_pattern`` / ``alpha_pattern``); so does a block
    whose own adapters differ from the trunk adapters' (``adapter_pattern``, ``stages[].adapters``)."""
    adapters = stacking.trunk_adapters(config)
    out: dict[str, torch.Tensor] = {}
    rank_pattern, alpha_pattern = {}, {}
    for i in sorted(stacking.trunk_storage(config)):
        for m in adapters.modules:
            path = spec.lora_module_path(i, m)
            pairs = _adapter_pairs(tensors, config, i, m)
            first = pairs[0][2]
            out[peft_name(f"{path}.lora_A")] = torch.cat([a for a, _, _ in pairs]).contiguous()
            out[peft_name(f"{path}.lora_B")] = torch.cat([b * (s / first) for _, b, s in pairs], dim=1).contiguous()
            rank = sum(a.shape[0] for a, _, _ in pairs)
            if len(pairs) > 1 or rank != adapters.rank or first != adapters.scaling:  # progressive, or a stage's own
                rank_pattern[path] = rank  # alpha such that alpha / r (or / sqrt(r)) is the first's scaling
                alpha_pattern[path] = first * (rank ** 0.5 if adapters.rslora else rank)
    doc = {"layers_to_transform": sorted(stacking.trunk_storage(config)), "layers_pattern": "layers",
           "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern}
    return out, doc
