"""What `apr train validate` refuses about multi-head latent attention
(``model.architecture.attention: {kind: mla}``, apr/model/mla.py; docs/mla.md), each at its key.
Torch-free.

The schema refuses what the section alone gets wrong (a missing or odd width, a RoPE part wider
than a head); this module what other keys cannot work with: latent attention gives every query
head its own keys and values from the latent (no key/value head count), is built on the llama block
(no q/k/v biases, no sliding window, no decoupled attention, no YaRN: DeepSeek's YaRN scales the
whole score, apr's the RoPE tables), and what reads the standard projections by name (LoRA's
adapters, a stacking trunk, a distillation student's initialisation, a Hugging Face folder's
weights) is refused with it until it is built for the latent projections.
"""

from __future__ import annotations

import os
from functools import partial

from apr.config import LoadedConfig
from apr.errors import Finding
from apr.plan.keyfacts import key_error

_finding = partial(key_error, code="config.mla")


def _hf_folder(path: str | None) -> bool:
    return path is not None and os.path.isfile(os.path.join(os.path.expanduser(str(path)), "config.json"))


def mla_config_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    model, arch = c.model, c.model.architecture
    if arch.mla is None:
        return []
    a = ("model", "architecture")
    not_built = "not built for multi-head latent attention: "
    rs = arch.rope_scaling
    teacher = c.training.distill is not None and c.training.distill.init_from_teacher
    checks = [
        (arch.num_key_value_heads not in (None, arch.num_attention_heads), (*a, "num_key_value_heads"),
         "latent attention expands every query head's own key and value from the latent: there is no separate "
         "number of key/value heads (the KV cache is the latent, whatever the heads)",
         f"no num_key_value_heads, or {arch.num_attention_heads} (num_attention_heads)", str(arch.num_key_value_heads)),
        (arch.decoupled_attention is not None, (*a, "decoupled_attention"), "decoupled_attention and "
         "attention.kind: mla are two different attentions: a block has one", "one of them", "both"),
        (str(arch.family) != "llama", (*a, "family"), "latent attention is built on the llama block: qwen2's "
         "q/k/v biases and mistral's sliding window have no place in it", "family llama", str(arch.family)),
        (rs is not None and str(rs.rope_type) == "yarn", (*a, "rope_scaling", "rope_type"), "YaRN scales every "
         "attention score (DeepSeek's mscale); apr's YaRN scales the RoPE tables, which here turn only the "
         "qk_rope_head_dim part", "llama3, linear, dynamic or no rope_scaling", "yarn"),
        (model.lora is not None, ("model", "lora"), not_built + "LoRA adapts the standard q/k/v/o projections by "
         "name", "no model.lora", "set"),
        (model.stacking is not None, ("model", "stacking"), not_built + "progressive stacking's trunk stores and "
         "adapts the standard projections by name", "no model.stacking", "set"),
        (str(c.training.mode) == "distill" and teacher, ("training", "distill", "init_from_teacher"),
         not_built + "a student starts from its teacher's q/k/v projections", "init_from_teacher: false", "true"),
        (_hf_folder(model.init_from), ("model", "init_from"), not_built + "a Hugging Face folder's weights are "
         "read as a LLaMA-family checkpoint with standard attention (a DeepSeek MLA folder is not imported); an "
         "apr checkpoint of a run with the same attention section is", "an apr checkpoint, or no model.init_from",
         str(model.init_from)),
    ]
    return [_finding(loaded, key, message, expected, got) for bad, key, message, expected, got in checks if bad]
