"""Low-rank adapters (LoRA, Hu et al. 2021) on the blocks' projections, over a frozen base.

``LoRALinear`` keeps the base weight under its Hugging Face name (``...q_proj.weight``) and adds
``lora_A`` (rank x in) and ``lora_B`` (out x rank): ``y = x W^T + scaling * B(A(dropout(x)))``,
PEFT's order of operations, so an exported adapter gives PEFT the same logits. Shapes and names
come from ``apr.model.spec.lora_block_specs``; merging for export is ``W + scaling * B @ A``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from apr.config.schema import LoraConfig
from apr.model import spec
from apr.model.nf4 import dense, to_nf4


class LoRALinear(nn.Module):
    """A frozen linear layer (its bias too: Qwen2's q/k/v) plus a trainable low-rank update."""

    def __init__(self, weight: nn.Parameter, rank: int, scaling: float, dropout: float,
                 bias: nn.Parameter | None = None):
        super().__init__()
        out_features, in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=weight.device))
        self.scaling = scaling
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xa = F.dropout(x, self.dropout, self.training) if self.dropout else x
        weight = self.weight
        if weight.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            # a bf16 trunk read outside autocast (evaluation and samples compute in float32): the
            # bf16 values widened exactly, as autocast's cast of them back to bf16 would be
            weight = weight.to(x.dtype)
        return F.linear(x, weight, self.bias) + F.linear(F.linear(xa, self.lora_A), self.lora_B) * self.scaling


@torch.no_grad()
def add_adapters(model, lora: LoraConfig, seed: int) -> None:
    """Freeze every parameter of ``model`` and put adapters on the targeted projections.

    ``lora_A`` is drawn uniform in +-1/sqrt(in) (PEFT's default, kaiming-uniform with a = sqrt(5)) on
    the CPU from ``seed`` in ``spec.lora_block_specs`` order; ``lora_B`` is zero, so the adapted
    model starts exactly at the base model."""
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    arch = model.arch
    storage = str(lora.trunk_dtype)
    if storage != "fp32":  # the frozen projections in bf16 (half their memory) or NF4 (QLoRA: about an eighth)
        for i in range(arch.num_hidden_layers):
            for m in PROJECTIONS:
                parent_name, _, leaf = spec.lora_module_path(i, m).rpartition(".")
                linear = getattr(model.get_submodule(parent_name), leaf)
                linear.weight = nn.Parameter(stored(linear.weight, storage), requires_grad=False)
    for i in range(arch.num_hidden_layers):
        for m in lora.modules:
            path = spec.lora_module_path(i, m)
            parent_name, _, leaf = path.rpartition(".")
            parent = model.get_submodule(parent_name)
            base = getattr(parent, leaf)
            layer = LoRALinear(base.weight, lora.rank, lora.scaling, lora.dropout, base.bias)
            bound = 1.0 / math.sqrt(layer.lora_A.shape[1])
            layer.lora_A.copy_(torch.empty(layer.lora_A.shape).uniform_(-bound, bound, generator=gen))
            setattr(parent, leaf, layer)


def stored(weight: torch.Tensor, storage: str) -> torch.Tensor:
    """A float32 projection weight in the frozen base's storage: bf16, or an NF4Tensor (torchao).
    NF4 quantization is a function of the float32 weight, so every start (and a resume) quantizes
    ``model.init_from``'s weights to the same codes; only a dequantized weight would move some."""
    if storage == "nf4":
        return to_nf4(weight)
    return weight.detach().to(torch.bfloat16) if storage == "bf16" else weight.detach()


def as_stored(weight: torch.Tensor, storage: str) -> torch.Tensor:
    """``weight`` (float32) as the run reads it from its storage, in float32: bf16-rounded, or NF4
    quantized and dequantized (exactly what torchao's linear multiplies by)."""
    if storage == "nf4":
        return dense(stored(weight.float(), "nf4"))
    return stored(weight, storage).float()


def adapter_names(arch, lora: LoraConfig) -> list[str]:
    return [s.name for i in range(arch.num_hidden_layers) for s in spec.lora_block_specs(arch, lora, i)]


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def merge(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], arch, lora: LoraConfig
          ) -> dict[str, torch.Tensor]:
    """The base weights with every adapter folded in (``W + scaling * B @ A``, float32): a plain
    model with no adapters, as ``apr export --format hf`` writes it. With a bf16 or NF4 trunk the
    base projections are first what the run multiplied by (bf16-rounded; NF4 dequantized)."""
    out = base_as_trained(base, arch, lora)
    for i in range(arch.num_hidden_layers):
        for m in lora.modules:
            path = spec.lora_module_path(i, m)
            a, b = adapters[f"{path}.lora_A"].float(), adapters[f"{path}.lora_B"].float()
            out[f"{path}.weight"] = out[f"{path}.weight"].float() + (b @ a) * lora.scaling
    return out


@torch.no_grad()
def base_as_trained(base: dict[str, torch.Tensor], arch, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The base weights as the run's frozen model holds them (float32): the projections through
    their storage (``as_stored``), the rest as given. The base a PEFT export writes beside its
    adapters, so that PEFT computes the run's logits."""
    out = dict(base)
    storage = str(lora.trunk_dtype)
    if storage != "fp32":
        for i in range(arch.num_hidden_layers):
            for m in PROJECTIONS:
                name = f"{spec.lora_module_path(i, m)}.weight"
                out[name] = as_stored(base[name], storage)
    return out


def peft_name(name: str) -> str:
    """apr's adapter name -> PEFT's: ``model.layers.0.self_attn.q_proj.lora_A`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return f"base_model.model.{name}.weight"


def peft_config(arch, lora: LoraConfig, base: str) -> dict:
    """adapter_config.json for ``peft.PeftModel.from_pretrained``."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.rslora,
        "target_modules": list(lora.modules), "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
