"""``model.init_from``: start a run from trained weights, an apr checkpoint or a local Hugging Face
LLaMA folder (config.json + model.safetensors, or a sharded model.safetensors.index.json).

Two halves (docs/design.md, "Checkpoints"):

The source is read by apr/checkpoint/sources.py, the reader every command shares.

* ``inspect_source`` reads only JSON and safetensors headers (no torch, no weights): the source's
  kind, its tensors' names, shapes and dtypes, total bytes, the tokenizer beside it, and one
  finding per problem (a pickle file, another architecture's tensor names, a shape or architecture
  key that differs from the config). The plan shows these; ``apply`` refuses the same ones.
* ``load_source_weights`` loads the tensors as float32 under apr's names, which are Hugging Face's
  Llama names (apr/model/spec.py), so the weights need no renaming; the architecture keys of
  config.json are the same table export writes (``ARCH_TO_HF``), read the other way.

Nothing is unpickled: ``.bin`` / ``.pt`` files are refused with a finding naming the file.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from apr.checkpoint.files import sha256_file
from apr.checkpoint.manager import read_info
from apr.checkpoint.sources import SourceError, WeightSource, open_source
from apr.config.hf_folder import (  # noqa: F401  (re-exported: the weights side reads the same tables)
    ARCH_TO_HF,
    FAMILIES,
    REQUIRED_ARCH_KEYS,
    ROPE_TYPES,
    architecture_fields,
    family_problem,
    folder_architecture,
    resolve,
    unsupported_math,
    unsupported_message,
)
from apr.config.schema import LoraConfig, RopeScaling
from apr.errors import AprError, Finding
from apr.model.spec import param_specs

KEY = "model.init_from"

# Keys that do not change what the weights compute: not compared.
# max_position_embeddings only bounds seq_len (C-ARCH-004): RoPE tables are computed for any length,
# and the scalings that read it (llama3, yarn) carry their own original_max_position_embeddings.
_NOT_COMPARED = {"initializer_range", "max_position_embeddings"}
# Architecture attribute -> the config key a user edits (kv_heads is a property).
_CONFIG_KEY = {"kv_heads": "num_key_value_heads", "head_dim": "hidden_size"}

LOADABLE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code: F32, BF16, ...
    file: Path
    nbytes: int


@dataclass
class InitSource:
    """What ``inspect_source`` found. ``findings`` empty: the weights can be loaded into the config's model."""

    path: Path  # the folder or checkpoint file the config names
    kind: str  # "hf", "apr" or "unknown"
    tensors: dict[str, SourceTensor] = field(default_factory=dict)
    tokenizer: Path | None = None
    checkpoint_json: Path | None = None  # apr: the checkpoint's sidecar
    findings: list[Finding] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def facts(self) -> dict:
        """The plan's ``facts.init_from``: what is loaded and what loading it costs in host memory."""
        dtypes: dict[str, int] = {}
        for t in self.tensors.values():
            dtypes[LOADABLE_DTYPES.get(t.dtype, t.dtype)] = dtypes.get(LOADABLE_DTYPES.get(t.dtype, t.dtype), 0) + 1
        numel = sum(math.prod(t.shape) for t in self.tensors.values())
        return {"path": str(self.path), "kind": self.kind, "tensors": len(self.tensors), "params": numel,
                "dtypes": dtypes, "bytes": self.total_bytes,
                # the float32 host copy built while loading (the device buffers are the run's own)
                "host_bytes": 4 * numel,
                "files": sorted({str(t.file) for t in self.tensors.values()}),
                "tokenizer": str(self.tokenizer) if self.tokenizer else None,
                "errors": sum(f.severity == "error" for f in self.findings)}


def _finding(code: str, message: str, file: Path | str | None, path: str = KEY, expected: str | None = None,
             got: str | None = None) -> Finding:
    return Finding("error", f"init_from.{code}", message, path=path, file=str(file) if file else None,
                   expected=expected, got=got)


# ------------------------------------------------------------------------------------ inspect


def inspect_source(path_text: str, arch, depth: int = 0) -> InitSource:
    """Check ``model.init_from`` against ``arch`` (the config's Architecture) from headers alone
    (apr.checkpoint.sources reads the source; a problem it finds is a finding here)."""
    path = resolve(path_text)
    src = InitSource(path=path, kind="unknown")
    try:
        weights = open_source(path, verify=False)
    except SourceError as err:
        src.findings += [_as_init_from(f) for f in err.findings]
        return src
    if weights.kind == "safetensors":
        src.findings.append(_finding("unknown_source", f"{path_text} is a .safetensors file without a checkpoint "
                                     "JSON or a config.json: nothing says which model it is", path,
                                     expected="a Hugging Face folder or an apr checkpoint", got=path.name))
        return src
    if weights.kind == "hf":
        src.kind = "hf"
        if not _inspect_hf(src, weights, arch):
            return src
    else:
        src.kind = "apr"
        _inspect_apr(src, weights, arch, depth)
        if src.kind == "apr-lora":  # its trunk's tensors are its base's, read and checked there
            return src
    src.tensors = {n: SourceTensor(n, weights.shape(n), weights.dtype(n), weights.file_of(n), weights.nbytes(n))
                   for n in weights.names}
    # tensor names and shapes are checked unless config.json already says it is another model family
    if src.tensors and not any(f.code == "init_from.architecture" for f in src.findings):
        _check_tensors(src, arch)
    return src


def _as_init_from(f: Finding) -> Finding:
    """A weight source's finding as one of ``model.init_from``'s (``source.x`` -> ``init_from.x``)."""
    code = f"init_from.{f.code.split('.', 1)[1]}" if f.code.startswith("source.") else f.code
    return replace(f, code=code, path=f.path if f.path and f.code != "source.architecture" else KEY)


def _inspect_hf(src: InitSource, weights: WeightSource, arch) -> bool:
    """config.json against the config; False when it is missing or unreadable (nothing to check)."""
    if weights.config_path is None:
        src.findings.append(_finding("no_config", f"{src.path} has weights but no config.json", src.path,
                                     expected="config.json beside the weights", got="no config.json"))
        return False
    try:
        hf = weights.hf_config()
    except SourceError as err:
        src.findings += [_as_init_from(f) for f in err.findings]
        return False
    _check_hf_config(src, weights.config_path, hf, arch)
    if (src.path / "tokenizer.json").is_file():
        src.tokenizer = src.path / "tokenizer.json"
    return True


def _check_hf_config(src: InitSource, cfg_path: Path, hf: dict, arch) -> None:
    """One finding per config.json value that is not a model this apr runs, or differs from the config."""
    problem = family_problem(hf)
    if problem is not None:
        src.findings.append(_finding(
            "architecture", f"{cfg_path}: {problem[0]} is not a family apr imports", cfg_path, path=KEY,
            expected=problem[1], got=repr(hf.get("model_type"))))
        return
    for key, value, want in unsupported_math(hf):
        src.findings.append(_finding("architecture", unsupported_message(cfg_path, key, value, want), cfg_path,
                                     expected=want, got=f"{key}: {value!r}"))
    if any(f.code == "init_from.architecture" for f in src.findings):
        return
    _compare_arch(src, cfg_path, source_attributes(hf), arch)


def source_attributes(hf: Mapping) -> dict:
    """Architecture attribute -> value, for every one a config.json states or implies (family,
    kv_heads, rope_scaling and sliding_window always: absent means llama, MHA, none)."""

    fields = architecture_fields(hf)
    source = {attr: hf[key] for attr, key in ARCH_TO_HF if key in hf}
    if "num_key_value_heads" not in hf and "num_attention_heads" in hf:
        source["kv_heads"] = hf["num_attention_heads"]
    if "rope_theta" in fields:
        source["rope_theta"] = fields["rope_theta"]
    source["family"] = fields.get("family", "llama")
    scaling = fields.get("rope_scaling")
    source["rope_scaling"] = RopeScaling.model_validate(scaling) if scaling is not None else None
    source["sliding_window"] = fields.get("sliding_window")
    return source


def _same(value, mine) -> bool:
    if isinstance(mine, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(float(value) - float(mine)) <= 1e-12 * max(1.0, abs(float(mine)))
    return value == mine


def _shown(value) -> str:
    return repr(value.model_dump(exclude_none=True, mode="json") if hasattr(value, "model_dump") else
                getattr(value, "value", value))


def _compare_arch(src: InitSource, file: Path, source: Mapping, arch) -> None:
    for attr, value in source.items():
        if attr in _NOT_COMPARED:
            continue
        mine = getattr(arch, attr)
        if not _same(value, mine):
            key = f"model.architecture.{_CONFIG_KEY.get(attr, attr)}"
            src.findings.append(_finding(
                "architecture_mismatch", f"{attr} is {_shown(value)} in {file.name} but {_shown(mine)} in the config "
                f"({key}); set it to {_shown(value)} or leave it out (the folder's value is used)", file, path=key,
                expected=_shown(value), got=_shown(mine)))


MAX_STAGES = 8  # LoRA stages chained through init_from (a loop of checkpoints stops here)


def stage_base(info) -> str | None:
    """A LoRA checkpoint's ``model.init_from`` as its run opened it (relative to the run's cwd)."""
    text = (info.config.get("model") or {}).get("init_from")
    if not isinstance(text, str):
        return None
    path = Path(text).expanduser()
    return str(Path(info.cwd) / path if not path.is_absolute() and info.cwd else path)


def _inspect_apr(src: InitSource, weights: WeightSource, arch, depth: int = 0) -> None:
    info = weights.info
    try:
        own = weights.architecture()
    except SourceError as err:
        src.findings += [_as_init_from(f) for f in err.findings]
        return
    src.checkpoint_json = info.json_path
    _compare_arch(src, info.json_path, {attr: getattr(own, attr) for attr, _ in ARCH_TO_HF} |
                  {a: getattr(own, a) for a in ("rope_theta", "family", "rope_scaling", "sliding_window")}, arch)
    if ((info.config.get("model") or {}).get("lora")) is not None:
        # a LoRA stage: the next stage's frozen trunk is its base with its adapters merged in
        src.kind = "apr-lora"
        base_text = stage_base(info)
        if base_text is None or depth >= MAX_STAGES:
            src.findings.append(_finding("bad_checkpoint", f"{info.json_path.name} is a LoRA checkpoint without a "
                                         f"usable base (model.init_from {base_text!r})", info.json_path))
            return
        base = inspect_source(base_text, arch, depth + 1)
        src.findings += base.findings
        src.tensors.update(base.tensors)
        src.tokenizer = base.tokenizer


def expected_shapes(arch) -> dict[str, tuple[int, ...]]:

    return {p.name: p.shape for p in param_specs(arch)}


def _check_tensors(src: InitSource, arch) -> None:
    """One finding per foreign tensor name (first 5), per wrong shape or dtype; one for missing ones."""
    want = expected_shapes(arch)
    extra = [t for n, t in src.tensors.items()
             if n not in want and not (n == "lm_head.weight" and arch.tie_word_embeddings)]
    for t in extra[:5]:
        llama_like = t.name.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head"))
        why = "not a tensor of the config's model" if llama_like else \
            "not a LLaMA tensor name (another architecture, e.g. GPT-2's transformer.h.N...)"
        src.findings.append(_finding("foreign_tensor", f"{t.file}: tensor {t.name} is {why}", t.file,
                                     expected="LlamaForCausalLM names such as model.layers.0.self_attn.q_proj.weight",
                                     got=t.name))
    if len(extra) > 5:
        src.findings.append(_finding("foreign_tensor", f"... and {len(extra) - 5} more unexpected tensors",
                                     extra[5].file))
    missing = [n for n in want if n not in src.tensors]
    if missing:
        src.findings.append(_finding("missing_tensor", f"{len(missing)} tensor(s) of the config's model are not "
                                     f"in {src.path}, e.g. {', '.join(missing[:3])}", src.path,
                                     expected=missing[0], got="absent"))
    bad = 0
    for name, shape in want.items():
        t = src.tensors.get(name)
        if t is None:
            continue
        if t.shape != shape:
            bad += 1
            if bad <= 10:
                src.findings.append(_finding("shape", f"{t.file}: tensor {name} has shape {list(t.shape)}, the "
                                             f"config's model needs {list(shape)}", t.file,
                                             expected=str(list(shape)), got=str(list(t.shape))))
        if t.dtype not in LOADABLE_DTYPES:
            src.findings.append(_finding("dtype", f"{t.file}: tensor {name} is {t.dtype}", t.file,
                                         expected="F32, BF16 or F16", got=t.dtype))
    if bad > 10:
        src.findings.append(_finding("shape", f"... and {bad - 10} more tensors of the wrong shape", src.path))


# --------------------------------------------------------------------------------------- load


class InitFromError(AprError):
    """``model.init_from`` cannot be loaded into the config's model."""


def check_source(path_text: str, arch) -> InitSource:
    """``inspect_source``, raising InitFromError with its findings when it found any error."""
    src = inspect_source(path_text, arch)
    if not src.ok:
        errors = [f for f in src.findings if f.severity == "error"]
        raise InitFromError(f"model.init_from {path_text}: {errors[0].message}", errors)
    return src


def load_source_weights(path_text: str, arch) -> dict:
    """The model's parameters from ``model.init_from`` as float32 CPU tensors under HF Llama names.
    An apr checkpoint's size and SHA-256 are verified; its optimizer state is not loaded (a run
    started from weights begins its own AdamW moments)."""
    import torch

    src = check_source(path_text, arch)
    if src.kind == "apr-lora":
        return _merged_stage(src, arch)
    try:  # the checkpoint the check read (a run folder's newest), now verified
        weights = open_source(src.checkpoint_json if src.kind == "apr" else src.path)
        return weights.read(list(expected_shapes(arch)), dtype=torch.float32)
    except SourceError as err:
        raise InitFromError(f"model.init_from {path_text}: {err.message}", [_as_init_from(f)
                                                                           for f in err.findings]) from None


def load_into(model, path_text: str) -> None:
    """Copy ``model.init_from``'s weights into ``model`` (an apr LlamaForCausalLM, before the engine
    flattens it)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in load_source_weights(path_text, model.arch).items():
            params[name].copy_(t)


def source_digest(path_text: str, arch) -> str:
    """SHA-256 naming the source's weights: an apr checkpoint's recorded one, or for a Hugging Face
    folder the SHA-256 of its weight files' names and SHA-256s. A LoRA checkpoint records it, so
    resuming or exporting onto other base weights is refused."""

    src = check_source(path_text, arch)
    if src.kind in ("apr", "apr-lora"):  # a LoRA stage: its adapters; they pin their own base

        return str(read_info(src.checkpoint_json).doc["weights_sha256"])
    lines = [f"{p.name} {sha256_file(p)[0]}\n" for p in sorted({t.file for t in src.tensors.values()})]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _merged_stage(src: InitSource, arch) -> dict:
    """A LoRA checkpoint as a trunk: its base (checked against the SHA-256 it recorded) with its
    adapters merged in, float32; the next stage trains a new adapter set over it."""
    from apr.model.lora import merge

    info = read_info(src.checkpoint_json)
    base_text = stage_base(info)
    recorded = ((info.doc.get("engine") or {}).get("base") or {}).get("sha256")
    actual = source_digest(base_text, arch)
    if recorded != actual:
        message = (f"{src.checkpoint_json.name}'s adapters were trained on base weights with SHA-256 {recorded}; "
                   f"{base_text} now has {actual}")
        raise InitFromError(message, [_finding("base_changed", message, base_text, expected=str(recorded),
                                               got=actual)])
    adapters = open_source(src.checkpoint_json).read()
    lora = LoraConfig.model_validate(info.config["model"]["lora"])
    return merge(load_source_weights(base_text, arch), adapters, arch, lora)


def source_architecture(path_text: str):
    """The Architecture a weights source holds (a Hugging Face folder's config.json, or an apr
    checkpoint's stored config at its step's depth), read without loading weights: the teacher of
    a distillation. Raises InitFromError (key ``training.distill.teacher``) when it has none."""
    key = "training.distill.teacher"
    try:
        return open_source(resolve(path_text), verify=False).architecture()
    except SourceError as err:
        raise InitFromError(f"{key} {path_text}: {err.message}",
                            [replace_path(f, key) for f in err.findings]) from None


def replace_path(f: Finding, key: str) -> Finding:
    return replace(f, path=key)
