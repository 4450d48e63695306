"""Export a checkpoint as a Hugging Face folder of its family (Llama, Mistral or Qwen2:
``model.architecture.family``; Mixtral for a mixture of experts) that `transformers` loads offline.

    config.json               the family's config fields; RoPE (and its scaling) in the installed
                              transformers' form
    model.safetensors         weights only, HF names (no optimizer state; no lm_head when tied)
    generation_config.json    bos / eos / pad token ids
    tokenizer.json            the run's tokenizer (``data.tokenizer``), copied
    tokenizer_config.json     tokenizer class, special tokens (eos), model_max_length

The folder is built under a temp name beside ``out`` and renamed into place at the end, so a
crash never leaves a half-written export that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from apr.checkpoint import files
from apr.checkpoint.hf_import import ARCH_TO_HF, FAMILIES, check_source, load_source_weights, source_digest
from apr.checkpoint.manager import CheckpointError, CheckpointInfo, load_latest, read_checkpoint
from apr.checkpoint.names import is_optimizer_state
from apr.config.schema import AprConfig
from apr.errors import AprError, Finding
from apr.fsutil import check_output_folder, fsync_dir
from apr.model.spec import expert_intermediate_size
from apr.readers import read_text
from apr.steps import stacking

# Special tokens recognised by name, most specific first. A tokenizer made by `apr data
# train-tokenizer` carries "<|endoftext|>"; the others cover tokenizers from elsewhere.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "<|bos|>", "[CLS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
UNK_NAMES = ("<unk>", "<|unk|>", "[UNK]")


@dataclass
class ExportResult:
    out_dir: Path
    step: int
    checkpoint: Path
    files: list[str]
    eos_token: str | None
    tokenizer: Path | None
    rope_form: str  # "rope_parameters" (transformers >= 5) or "rope_theta"
    warnings: list[str] = field(default_factory=list)
    base: Path | None = None  # --format peft: the base model the adapters load onto


def installed_transformers_major() -> int | None:
    """Major version of the installed transformers, read from package metadata (no import)."""
    try:
        return int(metadata.version("transformers").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None


def _resolve_tokenizer(tokenizer: str | os.PathLike | None, config, info: CheckpointInfo) -> Path:
    given = tokenizer if tokenizer is not None else config.data.tokenizer
    if given is None:
        raise AprError("the checkpoint's config names no tokenizer (data.tokenizer); pass --tokenizer PATH",
                       [Finding("error", "export.no_tokenizer", "no tokenizer to export",
                                path="data.tokenizer", file=str(info.json_path))])
    path = Path(given).expanduser()
    candidates = [path]
    if not path.is_absolute() and tokenizer is None:
        # Config paths are relative to where the run was started, which the checkpoint records.
        if info.cwd:
            candidates.append(Path(info.cwd) / path)
    for c in candidates:
        if c.is_file():
            return c
    raise AprError(
        f"tokenizer {given} not found (looked at {', '.join(str(c) for c in candidates)}); "
        "pass --tokenizer PATH",
        [Finding("error", "export.tokenizer_missing", "tokenizer file not found",
                 path="data.tokenizer" if tokenizer is None else "", file=str(given))])


def _special_tokens(tokenizer_path: Path, vocab_size: int) -> dict[str, tuple[str, int] | None]:
    from tokenizers import Tokenizer

    text = read_text(tokenizer_path, "tokenizer", "tokenizer", error=AprError)  # bounded size
    try:
        tok = Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception on a bad file
        raise AprError(f"{tokenizer_path} is not a tokenizers tokenizer.json: {err}",
                       [Finding("error", "export.tokenizer_invalid", str(err), file=str(tokenizer_path))]
                       ) from None
    if tok.get_vocab_size() > vocab_size:
        raise AprError(
            f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocab_size is {vocab_size}",
            [Finding("error", "export.vocab_mismatch", "tokenizer larger than the embedding",
                     file=str(tokenizer_path), expected=f"<= {vocab_size}", got=str(tok.get_vocab_size()))])
    specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def pick(names: tuple[str, ...]) -> tuple[str, int] | None:
        for n in names:
            if n in specials:
                return n, specials[n]
        return None

    out = {"eos": pick(EOS_NAMES), "bos": pick(BOS_NAMES), "pad": pick(PAD_NAMES), "unk": pick(UNK_NAMES)}
    if out["eos"] is None and len(specials) == 1:  # a single special token is the document separator
        (name, idx), = specials.items()
        out["eos"] = (name, idx)
    return out


def hf_config(arch, specials: dict, transformers_major: int | None) -> tuple[dict, str]:
    """config.json for the architecture's family (LlamaForCausalLM, MistralForCausalLM or
    Qwen2ForCausalLM), and which RoPE form it uses."""
    tok_id = {k: (v[1] if v else None) for k, v in specials.items()}
    family = str(getattr(arch.family, "value", arch.family))
    doc = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        **{hf_key: getattr(arch, attr) for attr, hf_key in ARCH_TO_HF},  # import reads them back
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": tok_id["bos"],
        "eos_token_id": tok_id["eos"],
        "pad_token_id": tok_id["pad"],
    }
    if arch.moe is not None:  # Mixtral: the mistral block with the sparse MoE MLP (apr/model/moe.py)
        # HF's balance loss counts each of a token's top_k choices: the same penalty is coef / top_k
        doc.update(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=arch.sliding_window,
                   intermediate_size=expert_intermediate_size(arch), num_local_experts=arch.moe.num_experts,
                   num_experts_per_tok=arch.moe.top_k, router_aux_loss_coef=arch.moe.balance_loss_coef / arch.moe.top_k,
                   output_router_logits=False, router_jitter_noise=0.0)
    elif arch.mla is not None:  # DeepseekV3: its latent attention over dense llama MLPs in every layer (no MoE)
        m = arch.mla
        doc.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", kv_lora_rank=m.kv_lora_rank,
                   q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim, head_dim=m.qk_rope_head_dim,
                   qk_nope_head_dim=arch.head_dim - m.qk_rope_head_dim, v_head_dim=arch.head_dim,
                   first_k_dense_replace=arch.num_hidden_layers, rope_interleave=False, attention_bias=False,
                   pretraining_tp=1)
    elif family == "llama":
        doc.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family == "mistral":
        doc["sliding_window"] = arch.sliding_window
    else:  # qwen2: full attention in every layer (its per-layer window is not implemented)
        doc.update(use_sliding_window=False, sliding_window=None, max_window_layers=arch.num_hidden_layers,
                   layer_types=["full_attention"] * arch.num_hidden_layers)
    scaling = arch.rope_scaling.model_dump(mode="json", exclude_none=True) if arch.rope_scaling else None
    if scaling is not None and scaling["rope_type"] != "yarn":
        scaling.pop("truncate")  # a yarn key: transformers warns of it elsewhere
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": arch.rope_theta}
    if transformers_major is None:  # not installed: both forms, each version reads its own
        doc.update(rope_theta=arch.rope_theta, rope_scaling=scaling, rope_parameters=rope_parameters,
                   dtype="float32", torch_dtype="float32")
        form = "rope_parameters+rope_theta"
    elif transformers_major >= 5:  # 5.x moved rope_theta / rope_scaling into rope_parameters
        doc.update(rope_parameters=rope_parameters, dtype="float32")
        form = "rope_parameters"
    else:
        doc.update(rope_theta=arch.rope_theta, rope_scaling=scaling, torch_dtype="float32")
        form = "rope_theta"
    try:
        doc["transformers_version"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        pass
    return doc, form


def mixtral_weights(weights: dict, arch) -> dict:
    """apr's expert tensors under Mixtral's per-expert names (``block_sparse_moe.experts.<e>.w1/w2/w3``,
    gate, down and up), the layout transformers 4 reads and 5 converts on load; the rest as it is."""
    inter, out = expert_intermediate_size(arch), {}
    for name, t in weights.items():
        head, sep, tail = name.partition(".mlp.")
        if not sep:
            out[name] = t
        elif tail == "gate.weight":
            out[f"{head}.block_sparse_moe.gate.weight"] = t
        elif tail == "experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{head}.block_sparse_moe.experts.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"{head}.block_sparse_moe.experts.{e}.w3.weight"] = t[e, inter:].contiguous()
        else:  # experts.down_proj
            for e in range(t.shape[0]):
                out[f"{head}.block_sparse_moe.experts.{e}.w2.weight"] = t[e].contiguous()
    return out


def tokenizer_config(specials: dict, max_len: int) -> dict:
    doc: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    for kind in ("bos", "eos", "unk", "pad"):
        if specials[kind]:
            doc[f"{kind}_token"] = specials[kind][0]
    return doc


def _read_weights(checkpoint: str | os.PathLike, warnings: list[str]):
    path = Path(checkpoint)
    if path.is_dir():
        return load_latest(path, warn=warnings.append, weights_only=True)
    return read_checkpoint(path, weights_only=True)


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
              overwrite: bool = False, fmt: str = "hf", base: str | os.PathLike | None = None) -> ExportResult:
    """Export a checkpoint (.json, .safetensors, or a run directory meaning its latest good one) as a
    Hugging Face Llama folder at ``out``. ``tokenizer`` overrides the config's ``data.tokenizer``.

    A LoRA checkpoint (adapters only) is merged into its base (``model.init_from``, checked against
    the SHA-256 the checkpoint recorded); ``fmt="peft"`` writes the adapters as a PEFT folder instead
    (adapter_config.json + adapter_model.safetensors) that ``peft.PeftModel.from_pretrained`` loads
    onto the base, with the base itself exported as a Hugging Face folder in ``out/base/`` unless
    ``base`` names one (``--base HF_DIR``); ``base_model_name_or_path`` is that folder's absolute path.
    OSErrors while writing (a read-only folder, a full disk, EFBIG) become an AprError naming ``--out``;
    ``out`` is left as it was."""

    out = Path(out)
    warnings: list[str] = []
    # The output is checked before the checkpoint is read: a refusal is instant at any model size.
    check_output_folder(out, inputs=[checkpoint], option="--out")
    if base is not None and fmt != "peft":
        raise AprError("--base is for --format peft (the folder the adapters load onto)", [Finding(
            "error", "export.base_option", "--base given without --format peft", path="--base",
            expected="--format peft", got=f"--format {fmt}")])
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if overwrite and not _is_previous_export(out):
            raise AprError(
                f"{out} is not an earlier export, or holds files apr export did not write; --overwrite only "
                "replaces a folder apr export wrote, never anything else", [Finding(
                    "error", "export.out_not_export", "refusing to replace a folder apr did not write",
                    file=str(out), expected="an empty or missing folder, or an earlier export holding only "
                    + ", ".join(sorted(EXPORT_FILES)),
                    got=", ".join(sorted(p.name for p in out.iterdir())[:8]) if out.is_dir() else "a file")])
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise AprError(f"{out} already exists and is not empty; pass --overwrite to replace it",
                       [Finding("error", "export.out_exists", "output folder not empty", file=str(out))])
    state = _read_weights(checkpoint, warnings)
    info = state.info
    assert info is not None
    try:
        config = AprConfig.model_validate(info.config)
    except Exception as err:  # pydantic ValidationError
        raise CheckpointError(f"{info.json_path.name}: its stored config does not validate: {err}",
                              info.json_path, "not_apr") from None
    config = stacking.config_at(config, info.step)  # progressive stacking: the depth at that step
    arch = config.model.architecture
    refusal = _no_form(info, arch, fmt)
    if refusal is not None:
        raise refusal
    if fmt == "peft":
        return _export_peft(state, info, config, out, tokenizer=tokenizer, base_dir=base, warnings=warnings)
    # bf16 state (training.state_dtype) exports as float32, exactly: the folder's config says float32
    weights = {k: v.float() if str(v.dtype) == "torch.bfloat16" else v for k, v in state.tensors.items()
               if not is_optimizer_state(k)}
    if config.model.lora is not None:
        weights = merged_weights(weights, info, config)
    elif stacking.trunk_storage(config):  # a stacking trunk: dequantized, its adapters folded in
        from apr.model.trunk import merged_weights as trunk_merged  # lazy: torchao for NF4 trunks

        weights = trunk_merged(weights, config)
    if arch.moe is not None:
        weights = mixtral_weights(weights, arch)

    if tokenizer is None and config.data.tokenizer is None and config.model.init_from is not None:
        beside = Path(_base_path(config, info)) / "tokenizer.json"  # the base's tokenizer travels with it
        tokenizer = beside if beside.is_file() else None
    tok_path = _resolve_tokenizer(tokenizer, config, info)
    specials = _special_tokens(tok_path, arch.vocab_size)
    if specials["eos"] is None:
        warnings.append(f"{tok_path} has no end-of-text special token; eos_token is not set")
    major = installed_transformers_major()
    cfg_doc, rope_form = hf_config(arch, specials, major)

    del state
    _write_atomically(out, lambda tmp: _write_export(tmp, weights, info, cfg_doc, tok_path, specials, arch))
    return ExportResult(out_dir=out, step=info.step, checkpoint=info.json_path,
                        files=sorted(p.name for p in out.iterdir()),
                        eos_token=specials["eos"][0] if specials["eos"] else None, tokenizer=tok_path,
                        rope_form=rope_form, warnings=warnings)



def _no_form(info, arch, fmt: str) -> AprError | None:
    """What the chosen format has no form for, with the reason (apr export refuses it), or None."""
    name = info.json_path.name
    cases = [
        (arch.decoupled_attention is not None,
         f"{name} has decoupled bottleneck attention, which Hugging Face LLaMA cannot hold",
         "export.decoupled_attention", "no Hugging Face form for decoupled attention",
         "model.architecture.decoupled_attention", "standard (grouped-query) attention", str(arch.decoupled_attention)),
        (arch.time is not None,
         f"{name} has a time embedding (model.architecture.time), which no Hugging Face causal LM config can hold",
         "export.time", "no Hugging Face form for time conditioning", "model.architecture.time",
         "a model without model.architecture.time", str(arch.time)),
        (arch.mla is not None and arch.moe is not None,
         f"{name} has latent attention, exported as DeepseekV3, whose mixture of experts (shared experts, grouped "
         "sigmoid routing) is not apr's Mixtral-style one", "export.mla",
         "no DeepseekV3 form for latent attention with this mixture of experts", "model.architecture.moe",
         "latent attention with dense MLPs", str(arch.moe)),
        (arch.moe is not None and (fmt == "peft" or str(arch.family) == "qwen2"),
         f"{name} has a mixture of experts, exported as Mixtral, which has no q/k/v projection biases (family "
         "qwen2) and no PEFT form here", "export.moe", "no Mixtral form for this mixture of experts",
         "model.architecture.moe", "family llama or mistral, --format hf", f"family {arch.family}, --format {fmt}"),
    ]
    for hit, message, code, short, path, expected, got in cases:
        if hit:
            return AprError(message + ": use the apr checkpoint with apr generate and apr eval", [Finding(
                "error", code, short, path=path, file=str(info.json_path), expected=expected, got=got)])
    return None

def _base_path(config, info: CheckpointInfo) -> str:
    """``model.init_from`` as the run opened it (relative paths start where the run was started)."""
    base = Path(config.model.init_from).expanduser()
    if not base.is_absolute() and info.cwd:
        base = Path(info.cwd) / base
    return str(base)


def _checked_base(info: CheckpointInfo, config) -> str:
    """The LoRA checkpoint's base, refused unless its SHA-256 is the one the checkpoint recorded."""

    base = _base_path(config, info)
    recorded = ((info.doc.get("engine") or {}).get("base") or {}).get("sha256")
    actual = source_digest(base, config.model.architecture)
    if recorded != actual:
        raise AprError(f"{base} is not the base the adapters of {info.json_path.name} were trained on "
                       f"(SHA-256 {actual}, the checkpoint recorded {recorded})", [Finding(
                           "error", "export.base_changed", "the LoRA base weights changed",
                           path="model.init_from", file=base, expected=str(recorded), got=actual)])
    return base


def merged_weights(adapters: dict, info: CheckpointInfo, config) -> dict:
    """A LoRA checkpoint's adapters merged into its base (checked by SHA-256): full model weights."""
    from apr.model.lora import merge

    arch = config.model.architecture
    base = load_source_weights(_checked_base(info, config), arch)
    return merge(base, adapters, arch, config.model.lora)


PEFT_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})


PEFT_BASE = "base"  # the base model, exported beside the adapters, inside the PEFT folder


def _given_base(base_dir: str | os.PathLike, base: str | None, info: CheckpointInfo, config, ours=None) -> Path:
    """``--base HF_DIR``: a Hugging Face LLaMA folder of the config's architecture holding the very
    weights the adapters were trained on (same file digest, or equal tensors), else AprError.
    A stacked run's base is its own dequantized trunk (``ours``, no file): tensors compared."""
    import torch

    arch = config.model.architecture
    given = Path(base_dir).expanduser()
    src = check_source(str(given), arch) if given.exists() else None
    if src is None or src.kind != "hf" or src.findings:
        why = (src.findings[0].message if src is not None and src.findings else
               f"{given} is not a Hugging Face folder (config.json + model.safetensors)")
        raise AprError(f"--base {given}: {why}", [Finding(
            "error", "export.base_invalid", why, path="--base", file=str(given),
            expected="a Hugging Face LLaMA folder of the adapters' base", got=str(given))])
    recorded = ((info.doc.get("engine") or {}).get("base") or {}).get("sha256")
    if ours is not None or source_digest(str(given), arch) != recorded:
        ours, theirs = ours if ours is not None else load_source_weights(base, arch), load_source_weights(
            str(given), arch)
        differ = sorted(n for n in ours if n not in theirs or not torch.equal(ours[n], theirs[n]))
        if differ:
            base = base or "(the run's dequantized trunk)"
            raise AprError(f"--base {given} holds other weights than the adapters' base {base} ({differ[0]} "
                           "differs)", [Finding("error", "export.base_changed", "other base weights",
                                                path="--base", file=str(given), expected=f"the weights of {base}",
                                                got=f"{differ[0]} differs")])
    return given.resolve()


def _export_peft(state, info: CheckpointInfo, config, out: Path, *, tokenizer=None, base_dir=None,
                 warnings: list[str]) -> ExportResult:
    from apr.model.lora import base_as_trained, peft_config, peft_name

    trunk_lora = stacking.trunk_adapters(config)
    if config.model.lora is None and trunk_lora is None:
        raise AprError(f"{info.json_path.name} is not a LoRA checkpoint; --format peft exports adapters "
                       "(use --format hf)", [Finding("error", "export.not_lora", "no adapters to export",
                                                     path="model.lora", file=str(info.json_path))])
    arch = config.model.architecture
    if trunk_lora is not None:  # a stacked run: the base is its own trunk, dequantized (section 31)
        from apr.model.trunk import base_weights, peft_adapters  # lazy: torchao for NF4 trunks

        if not stacking.trunk_storage(config):
            raise AprError(f"{info.json_path.name} is from the first stage of a stacked run, which has no trunk "
                           "and so no adapters yet (use --format hf)", [Finding(
                               "error", "export.not_lora", "no trunk adapters at this step",
                               path="model.stacking.stages", file=str(info.json_path))])
        base, ours = None, base_weights(state.tensors, config)
        adapters, extra = peft_adapters(state.tensors, config)
    else:
        base, ours, extra = _checked_base(info, config), None, {}
        adapters = {peft_name(k): v for k, v in state.tensors.items() if not is_optimizer_state(k)}
    write_base = None
    if base_dir is not None:
        base_ref = _given_base(base_dir, base, info, config, ours=ours)
    else:
        # the base as a Hugging Face folder inside the export: transformers cannot load an apr run folder
        base_ref = Path(os.path.abspath(out)) / PEFT_BASE
        # the base as the run's frozen model held it (a bf16 or NF4 trunk as it multiplied), so PEFT
        # over it computes the run's logits; --base may name the original folder instead
        weights = ours if ours is not None else base_as_trained(load_source_weights(base, arch), arch,
                                                                config.model.lora)
        if (tokenizer is None and config.data.tokenizer is None and base is not None
                and (Path(base) / "tokenizer.json").is_file()):
            tokenizer = Path(base) / "tokenizer.json"
        try:
            tok_path = _resolve_tokenizer(tokenizer, config, info)
            specials = _special_tokens(tok_path, arch.vocab_size)
        except AprError as err:
            if tokenizer is not None:  # a tokenizer the user named must be usable
                raise
            tok_path, specials = None, {"eos": None, "bos": None, "pad": None, "unk": None}
            warnings.append(f"the base is exported without a tokenizer ({err.message})")
        cfg_doc, _ = hf_config(arch, specials, installed_transformers_major())
        write_base = (weights, cfg_doc, tok_path, specials)
    doc = {**peft_config(arch, trunk_lora or config.model.lora, str(base_ref)), **extra}

    def write(tmp: Path) -> None:
        files.write_safetensors(tmp / "adapter_model.safetensors", adapters, metadata={
            "format": "pt", "apr_step": str(info.step), "apr_config_hash": str(info.config_hash)})
        _write_json(tmp / "adapter_config.json", doc)
        with open(tmp / "adapter_config.json", "rb") as f:
            os.fsync(f.fileno())
        if write_base is not None:
            weights, cfg_doc, tok_path, specials = write_base
            (tmp / PEFT_BASE).mkdir()
            _write_export(tmp / PEFT_BASE, weights, info, cfg_doc, tok_path, specials, arch)

    _write_atomically(out, write)
    return ExportResult(out_dir=out, step=info.step, checkpoint=info.json_path,
                        files=sorted(p.name for p in out.iterdir()), eos_token=None, tokenizer=None,
                        rope_form="", warnings=warnings, base=base_ref)


def _write_atomically(out: Path, write) -> None:
    """``write(tmp)`` fills a temp folder beside ``out``, which then replaces ``out`` by renames. An
    OSError (read-only folder, full disk, file too large) is an AprError naming ``--out``; the temp
    folder is removed and ``out`` left as it was."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically_unchecked(out, write)
    except OSError as err:
        message = f"cannot write the export to --out {out}: {err.strerror or err}; nothing was replaced"
        raise AprError(message, [Finding("error", "export.write_failed", message, path="--out", file=str(out),
                                         expected="a folder apr can write", got=err.strerror or str(err))]
                       ) from None


def _write_atomically_unchecked(out: Path, write) -> None:
    _remove_leftovers(out)
    tmp = _temp_name(out, os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    old = None
    with _signals_raise():  # SIGTERM/SIGHUP unwind through the cleanup below, as Ctrl-C does
        tmp.mkdir()
        try:
            write(tmp)
            if out.exists():
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
            os.replace(tmp, out)
            old_done, old = old, None
            if old_done is not None:
                shutil.rmtree(old_done, ignore_errors=True)
            fsync_dir(out.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not out.exists():  # interrupted between the two renames
                os.replace(old, out)
            raise


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP during an export, so its temp folder is removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_raise():
    """While exporting, SIGTERM and SIGHUP raise (the temp folder is removed on the way out) and the
    process then dies of the same signal, as it would have; SIGINT already raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.getsignal(s) for s in wanted}

    def handler(signum, frame):
        raise _Terminated(signum)

    for s in wanted:
        if previous[s] in (signal.SIG_DFL, None):
            signal.signal(s, handler)
    try:
        yield
    except _Terminated as t:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        signal.signal(t.signum, signal.SIG_DFL)
        os.kill(os.getpid(), t.signum)  # die of the signal (exit status 128 + N), cleanup done
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _write_export(tmp: Path, weights: dict, info, cfg_doc: dict, tok_path: Path, specials: dict, arch) -> None:
    """The export's files, written and fsynced into ``tmp``."""
    files.write_safetensors(tmp / "model.safetensors", weights, metadata={
        "format": "pt",  # transformers refuses safetensors without it
        "apr_step": str(info.step),
        "apr_config_hash": str(info.config_hash),
    })
    _write_json(tmp / "config.json", cfg_doc)
    gen = {k: cfg_doc[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if gen["pad_token_id"] is None:
        gen["pad_token_id"] = gen["eos_token_id"]  # generate() would warn and do this itself
    if "transformers_version" in cfg_doc:
        gen["transformers_version"] = cfg_doc["transformers_version"]
    _write_json(tmp / "generation_config.json", gen)
    if tok_path is not None:  # a PEFT export's base may have none: the model loads without it
        shutil.copyfile(tok_path, tmp / "tokenizer.json")
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(specials, arch.max_position_embeddings))
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


EXPORT_FILES = frozenset({"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                          "tokenizer_config.json"})


def _is_previous_export(out: Path) -> bool:
    """A folder ``apr export`` wrote and nobody added to: config.json and model.safetensors, and
    nothing but the files an export writes (a file a user added there is never deleted)."""
    if not out.is_dir() or out.is_symlink():
        return False
    entries = list(out.iterdir())
    names = {p.name for p in entries}
    if names == PEFT_FILES | {PEFT_BASE}:  # a PEFT export with its base inside
        entries = [p for p in entries if p.name != PEFT_BASE]
        names = PEFT_FILES
        if not _is_previous_export(out / PEFT_BASE) or (out / PEFT_BASE).is_symlink():
            return False
    return (({"config.json", "model.safetensors"} <= names and names <= EXPORT_FILES
             or names == PEFT_FILES) and all(p.is_file() and not p.is_symlink() for p in entries))


def _temp_name(out: Path, pid: int) -> Path:
    return out.with_name(f".{out.name}.export-{pid}.tmp")


def _remove_leftovers(out: Path) -> None:
    """Temp and replaced folders of an export into ``out`` whose process is gone (killed outright)."""
    for prefix in (f".{out.name}.export-", f".{out.name}.old-"):
        for p in out.parent.glob(f"{prefix}*"):
            pid = p.name[len(prefix):].removesuffix(".tmp")
            if pid.isdigit() and not _alive(int(pid)) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
