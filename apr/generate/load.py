"""Load a model and its tokenizer for inference from any weight source apr reads
(apr/checkpoint/sources.py: a checkpoint, a run directory, a Hugging Face folder, single or sharded).

The weights come back as a float32 ``LlamaForCausalLM`` in eval mode; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.checkpoint.export import (
    EOS_NAMES,  # end-of-text names, most specific first
    merged_weights,
)
from apr.checkpoint.sources import WeightSource, open_source
from apr.data.tokenizer import load_tokenizer
from apr.errors import AprError, Finding
from apr.readers import check_regular, load_json
from apr.steps import stacking


class LoadError(AprError):
    """The model or tokenizer to generate or evaluate with cannot be loaded."""


@dataclass
class Loaded:
    """A model ready for inference and what it was loaded from."""

    model: Any  # apr.model.llama.LlamaForCausalLM, float32, eval mode
    tokenizer: Any  # tokenizers.Tokenizer (None only when loaded with need_tokenizer=False)
    tokenizer_path: Path | None
    source: Path
    kind: str  # "checkpoint" | "run" | "hf"
    step: int | None
    eos_id: int | None
    config: Any = None  # the AprConfig of an apr checkpoint; None for a Hugging Face folder
    warnings: list[str] = field(default_factory=list)

    @property
    def arch(self):
        return self.model.arch

    @property
    def context(self) -> int:
        return self.model.arch.max_position_embeddings

    @property
    def device(self):
        return self.model.model.embed_tokens.weight.device


def load_for_inference(source: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
                       device: str = "cpu", need_tokenizer: bool = True) -> Loaded:
    """Load ``source``, any weight source apr reads (apr.checkpoint.sources: a checkpoint, a run
    directory, a Hugging Face folder, single or sharded). ``tokenizer`` overrides the tokenizer the
    source names. Without ``need_tokenizer`` a missing tokenizer leaves ``Loaded.tokenizer`` None
    instead of failing (loss needs only ids)."""
    warnings: list[str] = []
    src = open_source(source, warn=warnings.append)
    torch_device = _device(device)
    if src.info is None:
        return _load_hf(src, tokenizer, torch_device, need_tokenizer)
    return _load_apr(src, tokenizer, torch_device, need_tokenizer, warnings)


def refuse_masked_lm(config, where: Path, action: str) -> None:
    """Raise if ``config`` (an apr checkpoint's) trained the masked-LM objective (``training.mode:
    mlm``): its attention looks both ways, and ``action`` (generation, a next-token loss, a Hugging
    Face causal LM) reads the model left to right."""
    if config is not None and str(config.training.mode) == "mlm":
        raise LoadError(f"{where} was trained with training.mode: mlm (a masked LM, attending both ways); it cannot "
                        f"be {action}, which reads the model left to right", [Finding(
                            "error", "source.mlm", "a masked-LM checkpoint", file=str(where),
                            expected="a checkpoint of training.mode causal_lm or distill", got="training.mode: mlm")])


def refuse_masked_lm_source(source: str | os.PathLike, action: str) -> None:
    """``refuse_masked_lm`` for any weight source, reading only its config (apr export's check)."""
    src = open_source(source, verify=False)
    if src.info is not None:
        refuse_masked_lm(src.apr_config(), src.path, action)


def _device(device: str):
    import torch

    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise LoadError(f"unknown device {device!r}", [Finding(
            "error", "generate.device", "unknown device", path="--device", expected="cpu or cuda", got=device)])
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LoadError("--device cuda was asked for but this torch sees no CUDA device", [Finding(
            "error", "generate.device", "no CUDA device", path="--device", expected="cpu", got=device)])
    return torch.device(device)


def _build(arch, tensors: dict, device, where: Path):
    import torch

    from apr.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    weights = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:
        first = str(err).splitlines()[0][:300]
        raise LoadError(f"{where}: the weights do not fit the model its config describes: {first}", [Finding(
            "error", "generate.weights", first, file=str(where))]) from None
    model = model.to(device=device, dtype=torch.float32)
    model._rope.clear()
    return model.eval()


def _load_apr(src: WeightSource, tokenizer, device, need_tokenizer: bool, warnings: list[str]) -> Loaded:
    info, kind, path = src.info, src.kind, src.path
    config = src.apr_config()  # progressive stacking: the depth at that step
    refuse_masked_lm(config, path, "loaded for generation or evaluation")
    tensors = src.read()
    if config.model.lora is not None:  # a LoRA run: its adapters merged into its base
        tensors = merged_weights(tensors, info, config)
    elif stacking.trunk_storage(config):  # a stacking trunk: dequantized, its adapters folded in
        from apr.model.trunk import merged_weights as trunk_merged  # lazy: torchao for NF4 trunks

        tensors = trunk_merged(tensors, config)
    model = _build(config.model.architecture, tensors, device, info.weights_path)
    if config.model.architecture.time is not None:  # eval_time's step, or the checkpoint's stage's
        from apr.model.time import set_fixed_step  # lazy: torch, as _build's

        set_fixed_step(model, config)
    try:
        tok_path = _checkpoint_tokenizer(tokenizer, config, info)
    except LoadError:
        if need_tokenizer or tokenizer is not None:  # a --tokenizer given and unusable is never ignored
            raise
        return Loaded(model=model, tokenizer=None, tokenizer_path=None, source=path, kind=kind, step=src.step,
                      eos_id=None, config=config, warnings=warnings)
    tok = _open_tokenizer(tok_path, config.model.architecture.vocab_size)
    if tokenizer is not None:
        try:
            own = _checkpoint_tokenizer(None, config, info)
        except LoadError:
            own = None  # the run's own tokenizer is gone: nothing to compare with
        warnings += other_tokenizer_warning(tok_path, own, f"data.tokenizer of {info.json_path.name}")
    return Loaded(model=model, tokenizer=tok, tokenizer_path=tok_path, source=path, kind=kind, step=src.step,
                  eos_id=_eos_id(tok), config=config, warnings=warnings)


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def other_tokenizer_warning(given: Path, own: Path | None, own_name: str) -> list[str]:
    """A warning naming both digests when ``--tokenizer`` is not the model's own tokenizer file
    (by content: a copy of it is the same tokenizer)."""
    if own is None:
        return []
    a, b = _sha256(given), _sha256(own)
    if a is None or b is None or a == b:
        return []
    return [f"--tokenizer {given} (sha256 {a}) is not the tokenizer the model was trained with: {own} "
            f"({own_name}, sha256 {b}); ids decode as other text unless the two tokenizers agree"]


def _checkpoint_tokenizer(given, config, info) -> Path:
    if given is not None:
        path = Path(given).expanduser()
        if not os.path.lexists(path):
            raise LoadError(f"tokenizer {path} not found", [Finding(
                "error", "generate.tokenizer_missing", "no such file", path="--tokenizer", file=str(path))])

        check_regular(path, "tokenizer", error=LoadError)  # a FIFO, folder, device or symlink loop, named
        return path
    named = config.data.tokenizer
    if named is None:
        raise LoadError(f"{info.json_path}: the checkpoint's config names no tokenizer (data.tokenizer); "
                        "pass --tokenizer PATH", [Finding(
                            "error", "generate.no_tokenizer", "no tokenizer to decode with",
                            path="data.tokenizer", file=str(info.json_path), expected="a tokenizer.json",
                            got="none")])
    path = Path(named).expanduser()
    candidates = [path]
    if not path.is_absolute():
        if info.cwd:  # config paths are relative to where the run started, which the checkpoint records
            candidates.append(Path(info.cwd) / path)
        candidates.append(info.json_path.parent / path)
    for c in candidates:
        if c.is_file():
            return c
    raise LoadError(f"tokenizer {named} (data.tokenizer of {info.json_path.name}) not found; looked at "
                    + ", ".join(str(c) for c in candidates) + "; pass --tokenizer PATH", [Finding(
                        "error", "generate.tokenizer_missing", "tokenizer file not found", path="data.tokenizer",
                        file=str(info.json_path), expected="an existing tokenizer.json", got=str(named))])


def _load_hf(src: WeightSource, tokenizer, device, need_tokenizer: bool = True) -> Loaded:
    path = src.path
    arch = src.architecture()  # a bare .safetensors file is refused here: nothing says which model it is
    doc = src.hf_config()
    model = _build(arch, src.read(), device, src.files[0] if len(src.files) == 1 else path)
    tok_path = Path(tokenizer).expanduser() if tokenizer is not None else path / "tokenizer.json"
    if not tok_path.is_file() and not need_tokenizer and tokenizer is None:
        return Loaded(model=model, tokenizer=None, tokenizer_path=None, source=path, kind="hf", step=None,
                      eos_id=None)
    if tokenizer is not None:

        check_regular(tok_path, "tokenizer", error=LoadError)  # a FIFO, folder or device given, named
    if not tok_path.is_file():
        raise LoadError(f"{path} has no tokenizer.json; pass --tokenizer PATH", [Finding(
            "error", "generate.no_tokenizer", "no tokenizer to decode with", file=str(tok_path),
            expected="a tokenizer.json", got="none")])
    tok = _open_tokenizer(tok_path, arch.vocab_size)
    warnings = (other_tokenizer_warning(tok_path, path / "tokenizer.json", "the folder's own")
                if tokenizer is not None and (path / "tokenizer.json").is_file() else [])
    eos = doc.get("eos_token_id")
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        try:
            gen_doc = load_json(gen_cfg, "checkpoint", "generation_config.json", error=LoadError)
            eos = gen_doc.get("eos_token_id", eos) if isinstance(gen_doc, dict) else eos
        except AprError:
            pass  # optional: the tokenizer's end-of-text token is used instead
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return Loaded(model=model, tokenizer=tok, tokenizer_path=tok_path, source=path, kind="hf", step=None,
                  eos_id=eos if isinstance(eos, int) else _eos_id(tok), warnings=warnings)


def _open_tokenizer(path: Path, vocab_size: int):

    tok = load_tokenizer(path)
    if tok.get_vocab_size() > vocab_size:
        raise LoadError(f"the tokenizer {path} has {tok.get_vocab_size()} tokens but the model's vocab_size is "
                        f"{vocab_size}", [Finding("error", "generate.vocab_mismatch", "tokenizer larger than the model",
                                                 file=str(path), expected=f"<= {vocab_size}",
                                                 got=str(tok.get_vocab_size()))])
    return tok


def _eos_id(tok) -> int | None:
    for name in EOS_NAMES:
        idx = tok.token_to_id(name)
        if idx is not None:
            return int(idx)
    return None
