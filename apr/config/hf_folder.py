"""A Hugging Face folder's config.json read as ``model.architecture`` (torch-free; JSON only): the
families apr imports, the RoPE scalings it computes, and the keys a config may leave out when
``model.init_from`` names such a folder (apr.config.schema fills them from here). The weights side
is apr/checkpoint/hf_import.py, which reads the same tables."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path

from apr.readers import InputError, load_json


def resolve(path_text: str) -> Path:
    """A config path as the trainer opens it: ``~`` expanded, relative to the current directory."""
    return Path(os.path.abspath(os.path.expanduser(path_text)))


# Architecture attribute -> config.json key. Export writes config.json from this table and import
# checks config.json against the config with it: one mapping, two directions.
ARCH_TO_HF: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "intermediate_size"),
    ("num_hidden_layers", "num_hidden_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("initializer_range", "initializer_range"),
    ("rms_norm_eps", "rms_norm_eps"),
    ("tie_word_embeddings", "tie_word_embeddings"),
)


# config.json's model_type -> the transformers class a folder of that family holds. Each is the
# LLaMA decoder of apr/model/llama.py with the family's differences (Architecture.family).
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn")  # rope_type values apr computes as transformers does
_ROPE_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
              "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def _rope_block(hf: Mapping) -> tuple[str, object]:
    """(key, value) of the RoPE scaling a config.json states: transformers 5's ``rope_parameters``
    when it names a type other than default, else 4.x's ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_type", params.get("type")) not in (None, "default"):
        return "rope_parameters", params
    if hf.get("rope_scaling") is not None:
        return "rope_scaling", hf["rope_scaling"]
    return "rope_parameters", params if isinstance(params, Mapping) else None


def _rope_scaling(hf: Mapping) -> dict | None:
    """``model.architecture.rope_scaling`` from a config.json (None: plain RoPE), with the defaults
    transformers fills in written out (original_max_position_embeddings)."""
    _, block = _rope_block(hf)
    if not isinstance(block, Mapping) or block.get("rope_type", block.get("type")) not in ROPE_TYPES:
        return None
    out = {"rope_type": block.get("rope_type", block.get("type"))}
    out.update({k: block[k] for k in _ROPE_KEYS if block.get(k) is not None})
    if out["rope_type"] in ("llama3", "yarn"):
        out.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if out["rope_type"] == "yarn" and "factor" not in out and out.get("original_max_position_embeddings"):
        out["factor"] = hf.get("max_position_embeddings", 0) / out["original_max_position_embeddings"]
    return out


def architecture_fields(hf: Mapping) -> dict:
    """``model.architecture`` keys and values a config.json states (``ARCH_TO_HF`` read backwards;
    head_dim is derived from hidden_size and the heads, RoPE's theta comes in either form, and the
    family, RoPE scaling and a Mistral's sliding window follow)."""
    out = {("num_key_value_heads" if attr == "kv_heads" else attr): hf[key] for attr, key in ARCH_TO_HF
           if attr != "head_dim" and hf.get(key) is not None}
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), Mapping) else {}
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    if hf.get("model_type") in FAMILIES and hf["model_type"] != "llama":
        out["family"] = hf["model_type"]
    scaling = _rope_scaling(hf)
    if scaling is not None:
        out["rope_scaling"] = scaling
    if hf.get("model_type") == "mistral" and hf.get("sliding_window") is not None:
        out["sliding_window"] = hf["sliding_window"]
    return out


def unsupported_math(hf: Mapping) -> list[tuple[str, object, str]]:
    """(key path, value, what apr computes) for every config.json key whose value changes what the
    model computes in a way apr's model does not implement: a RoPE scaling type other than llama3,
    linear, dynamic and yarn (longrope, ...; in ``rope_scaling`` or transformers 5's
    ``rope_parameters``) or one missing the keys its type needs, partial rotary embeddings, biases
    a family does not have, another activation, a ``head_dim`` other than hidden_size /
    num_attention_heads, or Qwen2's per-layer sliding window. Such a model imported as plain
    LLaMA would load and run but compute something else; every reader of a config.json refuses these."""
    out: list[tuple[str, object, str]] = []
    key, value = _rope_block(hf)
    if value is not None and not isinstance(value, Mapping):
        out.append((key, value, "null or a mapping with rope_type default, " + ", ".join(ROPE_TYPES)))
    elif value:
        type_key = "rope_type" if "rope_type" in value else "type"
        kind = value.get(type_key)
        if kind not in (None, "default", *ROPE_TYPES):
            out.append((f"{key}.{type_key}", kind, f"RoPE scaling of type default, {', '.join(ROPE_TYPES)}"))
        elif kind is None and key == "rope_scaling":  # a scaling block without a type still carries a factor
            extra = sorted(k for k in value if k not in ("rope_type", "type", "rope_theta"))
            if extra:
                out.append((f"{key}.{extra[0]}", value[extra[0]], "a rope_type naming the scaling"))
        elif kind in ROPE_TYPES:
            problem = _rope_problem(hf)
            if problem is not None:
                out.append((f"{key}.{problem[0]}", value.get(problem[0]), problem[1]))
        factor = value.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            out.append((f"{key}.partial_rotary_factor", factor, "1 (rotary over the whole head)"))
    if hf.get("partial_rotary_factor") not in (None, 1, 1.0):
        out.append(("partial_rotary_factor", hf["partial_rotary_factor"], "1 (rotary over the whole head)"))
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if key in hf and hf[key] != want and not (key == "hidden_act" and hf[key] is None):
            out.append((key, hf[key], repr(want)))
    heads, hidden, head_dim = hf.get("num_attention_heads"), hf.get("hidden_size"), hf.get("head_dim")
    if (head_dim is not None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0
            and head_dim != hidden // heads):
        out.append(("head_dim", head_dim, f"hidden_size / num_attention_heads = {hidden // heads}"))
    if hf.get("model_type") == "qwen2" and hf.get("use_sliding_window"):
        out.append(("use_sliding_window", hf["use_sliding_window"], "false (full attention in every layer)"))
    layer_types = hf.get("layer_types")
    if isinstance(layer_types, list) and hf.get("model_type") != "mistral":
        other = sorted({t for t in layer_types if t != "full_attention"}, key=str)
        if other:
            out.append(("layer_types", other[0], '"full_attention" in every layer'))
    return out


def _rope_problem(hf: Mapping) -> tuple[str, str] | None:
    """(key, what is expected) when a llama3/linear/dynamic/yarn block lacks or mistypes a key (the
    rules of apr.config.schema.RopeScaling, which validates the architecture again)."""
    scaling = _rope_scaling(hf)
    needed = ("factor", "low_freq_factor", "high_freq_factor") if scaling["rope_type"] == "llama3" else ("factor",)
    for key in needed:
        if key not in scaling:
            return key, f"a {key} (rope_type {scaling['rope_type']} needs {', '.join(needed)})"
    numbers = {k: v for k, v in scaling.items() if k != "rope_type" and k != "truncate"}
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return key, "a finite number"
    if scaling["factor"] < 1:
        return "factor", "a factor >= 1"
    for key in ("low_freq_factor", "high_freq_factor", "attention_factor", "original_max_position_embeddings"):
        if key in numbers and numbers[key] <= 0:
            return key, f"{key} > 0"
    if scaling["rope_type"] == "llama3" and scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        return "low_freq_factor", "low_freq_factor < high_freq_factor"
    return None


def unsupported_message(where: Path | str, key: str, value: object, expected: str) -> str:
    return (f"{where}: {key} is {value!r}, which apr's model does not implement (it computes {expected}); "
            "importing it as it is would silently change the model's outputs")


def family_problem(hf: Mapping) -> tuple[str, str] | None:
    """(found, expected) when a config.json's model_type is no family apr imports."""
    model_type = hf.get("model_type")
    if model_type in FAMILIES:
        return None
    archs = hf.get("architectures")
    found = f"model_type {model_type!r}" + (f" ({', '.join(map(str, archs))})" if isinstance(archs, list) and archs
                                          else "")
    return found, " or ".join(f'"{t}" ({c})' for t, c in FAMILIES.items())


REQUIRED_ARCH_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                      "max_position_embeddings")


def folder_architecture(path_text: str) -> tuple[Path, dict | None, str | None] | None:
    """A Hugging Face folder's ``model.architecture`` (config.json read, nothing else): (config.json,
    the keys it states, None), or (config.json, None, why it cannot be imported); None when
    ``path_text`` is no folder with a config.json (an apr checkpoint, a missing path)."""
    path = resolve(path_text)
    cfg_path = path / "config.json"
    try:
        if not cfg_path.is_file():
            return None
        stat = cfg_path.stat()
    except OSError:
        return None
    return _folder_architecture(cfg_path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _folder_architecture(cfg_path: Path, mtime_ns: int, size: int) -> tuple[Path, dict | None, str | None]:
    try:
        hf = load_json(cfg_path, "manifest", "Hugging Face config")
    except InputError as err:
        return cfg_path, None, err.findings[0].message if err.findings else str(err)
    if not isinstance(hf, dict):
        return cfg_path, None, f"{cfg_path} is not a JSON object"
    problem = family_problem(hf)
    if problem is not None:
        return cfg_path, None, (f"{cfg_path}: {problem[0]} is not a family apr imports (expected {problem[1]})")
    for key, value, want in unsupported_math(hf)[:1]:
        return cfg_path, None, unsupported_message(cfg_path, key, value, want)
    return cfg_path, filled_fields(hf), None


def filled_fields(hf: Mapping) -> dict:
    """``architecture_fields`` with what a config.json may leave out filled in as transformers does:
    key/value heads (as many as the heads) and the context (early LLaMA conversions:
    max_sequence_length, else 2048). The model a weight source's config.json describes."""
    fields = architecture_fields(hf)
    if "num_key_value_heads" not in fields and "num_attention_heads" in fields:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if "max_position_embeddings" not in fields:
        fields["max_position_embeddings"] = hf.get("max_sequence_length") or 2048
    return fields
