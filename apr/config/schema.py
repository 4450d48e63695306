"""The config file's schema: one pydantic model per section, each default defined once here.

The layout follows the reference's ``configs/train/pretrain-350m-v2.yaml``. Unknown keys are
rejected (``extra="forbid"``); counts accept ``32_768``, ``512K``, ``10B``, ``1.5M``.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from apr import severity as severities
from apr.config.hf_folder import REQUIRED_ARCH_KEYS, folder_architecture
from apr.config.numbers import MAX_COUNT, parse_bytes, parse_count

# Experiment names and run ids: letters, digits, '.', '_' and '-'; starts with a letter or digit;
# never '..'; at most 128 characters (they become folder names and SQL values, and are printed).
SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SAFE_NAME_RULE = "1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, no '..'"


def is_safe_name(value: object) -> bool:
    return isinstance(value, str) and bool(SAFE_NAME_RE.match(value)) and ".." not in value


def _safe_name(value: object) -> object:
    if value is not None and not is_safe_name(value):
        raise ValueError(f"invalid experiment name: expected {SAFE_NAME_RULE}, got {value!r}")
    return value


ExperimentName = Annotated[str | None, BeforeValidator(_safe_name)]


def _folder_path(value: object) -> object:
    """A path the file system can name: no NUL byte (no system call takes one), not empty."""
    if isinstance(value, str) and "\0" in value:
        raise ValueError("expected a folder path without a NUL byte (no file system can name one), got a path "
                         "with one")
    if isinstance(value, str) and not value.strip():
        raise ValueError("expected a folder path, got an empty string")
    return value


FolderPath = Annotated[str, BeforeValidator(_folder_path)]

_COUNT_SCHEMA = {
    "anyOf": [
        {"type": "integer"},
        {"type": "string", "pattern": r"^[0-9][0-9_]*(\.[0-9_]+)?([eE][+-]?[0-9]+)?\s*[KMBGTkmbgt]?$"},
    ]
}


def _count(v: object) -> int:
    return parse_count(v)


def _opt_bytes(v: object) -> int | None:
    return None if v is None else parse_bytes(v)


Count = Annotated[int, BeforeValidator(_count), WithJsonSchema(_COUNT_SCHEMA)]
PositiveCount = Annotated[int, BeforeValidator(_count), Field(gt=0), WithJsonSchema({**_COUNT_SCHEMA})]
# a count the plan may fit: the loader takes ``auto`` out before the schema sees it (apr/config/auto.py)
FittedCount = Annotated[int, BeforeValidator(_count), Field(gt=0), WithJsonSchema(
    {"anyOf": [{**_COUNT_SCHEMA}, {"const": "auto"}]})]
NonNegCount = Annotated[int, BeforeValidator(_count), Field(ge=0), WithJsonSchema({**_COUNT_SCHEMA})]
ByteSize = Annotated[
    int | None,
    BeforeValidator(_opt_bytes),
    PlainSerializer(lambda v: v, return_type=int | None),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}),
]


# Numbers the trainer puts in float32 tensors, or the records in SQLite's signed 64-bit integers:
# beyond these a value is a typo (``1e300``) that would turn into inf or lose the run's records.
MAX_FLOAT = 3.4028234663852886e38  # float32's largest finite value
MAX_SEED = 2**63 - 1  # SQLite INTEGER and JSON readers hold it exactly; torch.manual_seed takes it
MAX_INDEX = 2**31 - 1  # block indices and thread counts torch takes as C ints


def _number(value: object) -> object:
    # pydantic would read `lr: true` as 1.0; a boolean where a number belongs is a mistake
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got a boolean ({str(value).lower()})")
    if isinstance(value, (int, float)) and abs(value) > MAX_FLOAT and abs(value) != float("inf"):
        raise ValueError(f"expected a number between -{MAX_FLOAT:.4g} and {MAX_FLOAT:.4g} (float32's range), "
                         f"got {value!r}")
    return value


def _integer(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got a boolean ({str(value).lower()})")
    return value


def _seed(value: object) -> object:
    _integer(value)
    if isinstance(value, int) and not 0 <= value <= MAX_SEED:
        raise ValueError(f"expected a seed from 0 to 2**63 - 1 ({MAX_SEED:,}: the run's records store it as a "
                         f"signed 64-bit integer), got {value:,}")
    return value


Float = Annotated[float, BeforeValidator(_number)]
Bool = Annotated[bool, Field(strict=True)]  # `shuffle: 1` or `"yes"` is not read as true
BlockIndex = Annotated[int, BeforeValidator(_integer), Field(ge=0, le=MAX_INDEX)]


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: 1e400`, `.inf`, `.nan` fail validate at their line (issue 24 item 14)
    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True, allow_inf_nan=False)


# ---------------------------------------------------------------------------------------- model


class ModelMode(StrEnum):
    transformer = "transformer"


class DecoupledAttention(_Section):
    """Decoupled bottleneck attention: per head a semantic query/key part without RoPE and a geometric
    part with RoPE, narrower than the head together. See docs/design.md, "Upcycling into a new architecture"."""

    sem_dim: PositiveCount = Field(description="Width per head of the semantic (position-free) query/key part.")
    geo_dim: PositiveCount = Field(description="Width per head of the geometric (RoPE) query/key part; even.")


class AttentionKind(StrEnum):
    gqa = "gqa"  # grouped-query attention: per-head keys and values (the default)
    mla = "mla"  # multi-head latent attention: keys and values from a compressed latent


class AttentionConfig(_Section):
    """Which attention each block uses. ``mla``: DeepSeek-V2's multi-head latent attention, keys and
    values decompressed per head from a ``kv_lora_rank`` latent plus one shared RoPE key of
    ``qk_rope_head_dim`` per token, which is all generation caches. See docs/mla.md."""

    kind: AttentionKind = Field(AttentionKind.gqa, description="gqa (grouped-query attention, the default) or mla "
                                "(multi-head latent attention).")
    kv_lora_rank: PositiveCount | None = Field(None, description="mla: width of the compressed key/value latent "
                                               "per token (what the KV cache holds, with the RoPE key).")
    qk_rope_head_dim: PositiveCount | None = Field(
        None, description="mla: width of each head's RoPE part of the query and key (the key's is shared by the "
        "heads); even, at most head_dim. The rest of the head (head_dim - qk_rope_head_dim) is position-free.")
    q_lora_rank: PositiveCount | None = Field(None, description="mla: compress the queries through a latent of "
                                              "this width. Default: a full-rank query projection.")

    @model_validator(mode="after")
    def _keys_of_its_kind(self):
        latent = {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                  "q_lora_rank": self.q_lora_rank}
        if self.kind == AttentionKind.gqa and any(v is not None for v in latent.values()):
            given = ", ".join(k for k, v in latent.items() if v is not None)
            raise ValueError(f"{given} are keys of multi-head latent attention: expected kind: mla, got kind: gqa")
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim") if latent[k] is None]
        if self.kind == AttentionKind.mla and missing:
            raise ValueError(f"kind: mla needs kv_lora_rank and qk_rope_head_dim: expected both, got no "
                             f"{' and no '.join(missing)}")
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs): expected an even width, got "
                             f"{self.qk_rope_head_dim}")
        return self


class MixtureOfExperts(_Section):
    """Each block's MLP as a router and ``num_experts`` SwiGLU experts, every token through its
    ``top_k`` experts (Mixtral's sparse MoE block). See docs/moe.md."""

    num_experts: PositiveCount = Field(ge=2, description="Experts per block (at least 2).")
    top_k: PositiveCount = Field(2, description="Experts each token is routed to; their gate weights are "
                                 "renormalised to sum to 1. At most num_experts.")
    expert_intermediate_size: PositiveCount | None = Field(
        None, description="SwiGLU hidden width of each expert. Default: model.architecture.intermediate_size.")
    balance_loss_coef: Float = Field(0.01, ge=0, description="Weight of the load-balancing loss (Switch "
                                     "Transformer's: num_experts x sum over experts of the share of tokens routed "
                                     "to it times its mean router probability; 1.0 when balanced) added to the "
                                     "training loss; 0 turns it off (it is still recorded).")

    @model_validator(mode="after")
    def _k_fits(self):
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k is {self.top_k}, more than num_experts {self.num_experts}: a token is "
                             "routed to top_k distinct experts")
        return self


class TimeEncoding(StrEnum):
    sinusoidal = "sinusoidal"  # fixed sines and cosines of the time step, then a learned projection
    learned = "learned"  # a learned table of one row per time step, then a learned projection


class TimeInterpretation(StrEnum):
    input = "input"  # each sequence draws its own time (diffusion-style)
    depth = "depth"  # the stacking stage fixes the time (progressive)


class StackTimeMapping(StrEnum):
    linear = "linear"  # stage k: k x time_per_stack
    exponential = "exponential"  # stage k: (2^k - 1) x time_per_stack


class TimeConditioning(_Section):
    """StackWise's time conditioning (docs/training.md, "Time conditioning"): a time step per sequence,
    embedded, projected to hidden_size and added to every position's token embedding."""

    embedding_dim: PositiveCount = Field(description="Width of the time encoding before its projection to "
                                         "hidden_size (StackWise's time_embedding_dim); even for sinusoidal.")
    encoding: TimeEncoding = Field(TimeEncoding.sinusoidal, description="sinusoidal (fixed sines and cosines of "
                                   "the step) or learned (a table of num_time_steps rows); either is followed by a "
                                   "learned embedding_dim x hidden_size projection (StackWise's "
                                   "time_encoding_type).")
    num_time_steps: PositiveCount = Field(1000, description="Time steps: a time t in [0, 1] is step "
                                          "min(floor(t x num_time_steps), num_time_steps - 1).")
    interpretation: TimeInterpretation = Field(
        TimeInterpretation.input, description="input: each training sequence draws its own t uniform in [0, 1] "
        "(from the run's seed, the step and the row's tokens); depth: every sequence of stacking stage k gets the "
        "stage's step (stack_time_mapping; needs model.stacking) (StackWise's time_interpretation).")
    stack_time_mapping: StackTimeMapping | None = Field(
        None, description="depth: stage k's step, min(k x time_per_stack, num_time_steps - 1) for linear, "
        "min((2^k - 1) x time_per_stack, num_time_steps - 1) for exponential. Default: linear.")
    time_per_stack: PositiveCount | None = Field(None, description="depth: the steps between stages "
                                                 "(StackWise's time_per_stack); needed there.")
    eval_time: Float | None = Field(
        None, ge=0, le=1, description="input: the time t at which validation, apr eval and apr generate run the "
        "model. Default 0.5. (depth: the checkpoint's stage's step.)")
    masking: Bool = Field(False, description="Time-step masking (needs training.mode: mlm): a sequence at step s "
                          "is masked at rate (s + 1) / num_time_steps instead of training.mlm.mask_rate.")

    @model_validator(mode="after")
    def _interpretation_keys(self):
        if self.encoding == TimeEncoding.sinusoidal and self.embedding_dim % 2:
            raise ValueError(f"a sinusoidal time encoding pairs sines and cosines: expected an even embedding_dim, "
                             f"got {self.embedding_dim}")
        if self.interpretation == TimeInterpretation.input and (self.stack_time_mapping or self.time_per_stack):
            raise ValueError("stack_time_mapping and time_per_stack map stacking stages to time: expected "
                             "interpretation: depth, got input")
        if self.interpretation == TimeInterpretation.depth and (self.time_per_stack is None or
                                                                self.eval_time is not None):
            raise ValueError("interpretation depth takes each stage's time from time_per_stack (needed) and runs "
                             f"a checkpoint at its stage's: expected time_per_stack and no eval_time, got "
                             f"time_per_stack {self.time_per_stack}, eval_time {self.eval_time}")
        return self


class ModelFamily(StrEnum):
    """The Hugging Face family a model is read from and exported as; all are the same decoder."""

    llama = "llama"  # LlamaForCausalLM (LLaMA 1/2/3.x, SmolLM2, TinyLlama)
    mistral = "mistral"  # MistralForCausalLM: LLaMA with an optional sliding attention window
    qwen2 = "qwen2"  # Qwen2ForCausalLM: LLaMA with biases on the q, k and v projections


class RopeType(StrEnum):
    llama3 = "llama3"
    linear = "linear"
    dynamic = "dynamic"
    yarn = "yarn"


class RopeScaling(_Section):
    """RoPE frequency scaling as transformers computes it (``rope_scaling`` / ``rope_parameters`` of
    a config.json); apr/model/llama.py ``rope_frequencies`` implements each type."""

    rope_type: RopeType = Field(description="llama3 (Llama 3.1+), linear (positions divided by factor), dynamic "
                                "(NTK, base grows past max_position_embeddings), yarn.")
    factor: Float = Field(ge=1, description="Context extension factor.")
    original_max_position_embeddings: PositiveCount | None = Field(
        None, description="Pretraining context (llama3, yarn). Default: max_position_embeddings.")
    low_freq_factor: Float | None = Field(None, gt=0, description="llama3: wavelengths above original / this are "
                                          "divided by factor.")
    high_freq_factor: Float | None = Field(None, gt=0, description="llama3: wavelengths below original / this are "
                                           "kept.")
    attention_factor: Float | None = Field(None, gt=0, description="yarn: cos/sin scale. Default: from factor "
                                           "(and mscale, mscale_all_dim).")
    beta_fast: Float | None = Field(None, description="yarn: fast boundary of the ramp (default 32).")
    beta_slow: Float | None = Field(None, description="yarn: slow boundary of the ramp (default 1).")
    mscale: Float | None = Field(None, description="yarn: numerator scale of the attention factor.")
    mscale_all_dim: Float | None = Field(None, description="yarn: denominator scale of the attention factor.")
    truncate: Bool = Field(True, description="yarn: round the ramp's boundaries to whole dimensions.")

    @model_validator(mode="after")
    def _keys_of_its_type(self):
        if self.rope_type == RopeType.llama3 and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ValueError("rope_type llama3 needs low_freq_factor and high_freq_factor, expected both, got "
                             f"low_freq_factor {self.low_freq_factor}, high_freq_factor {self.high_freq_factor}")
        if self.rope_type == RopeType.llama3 and self.low_freq_factor >= self.high_freq_factor:
            raise ValueError(f"expected low_freq_factor < high_freq_factor, got {self.low_freq_factor} >= "
                             f"{self.high_freq_factor}")
        return self


class Architecture(_Section):
    """LLaMA-style decoder shapes. Names follow Hugging Face's LlamaConfig."""

    hidden_size: PositiveCount = Field(description="Model width (d_model).")
    num_hidden_layers: PositiveCount = Field(description="Number of transformer blocks.")
    num_attention_heads: PositiveCount = Field(description="Query heads per block.")
    num_key_value_heads: PositiveCount | None = Field(
        None, description="Key/value heads (GQA). Defaults to num_attention_heads (plain MHA)."
    )
    intermediate_size: PositiveCount = Field(description="SwiGLU hidden width (gate/up/down).")
    vocab_size: PositiveCount = Field(
        le=2**32, description="Embedding rows and LM-head outputs (token ids are uint32, so at most 2**32).")
    max_position_embeddings: PositiveCount = Field(description="Longest sequence RoPE is built for.")
    rms_norm_eps: Float = Field(1.0e-5, gt=0, description="RMSNorm epsilon.")
    rope_theta: Float = Field(10000.0, gt=0, description="RoPE base frequency.")
    tie_word_embeddings: Bool = Field(False, description="Share the embedding matrix with the LM head.")
    initializer_range: Float = Field(0.02, gt=0, description="Std of the normal init of linear layers.")
    decoupled_attention: DecoupledAttention | None = Field(
        None, description="Decoupled bottleneck attention instead of standard attention (apr checkpoints "
        "only: no Hugging Face export). Default: standard attention.")
    family: ModelFamily = Field(ModelFamily.llama, description="Hugging Face family: llama, mistral (sliding_window) "
                                "or qwen2 (q/k/v projection biases); export writes it back. Read from "
                                "model.init_from's config.json.")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE frequency scaling (Llama 3.1+: llama3). "
                                             "Default: plain RoPE.")
    sliding_window: PositiveCount | None = Field(
        None, description="mistral: each position attends to the last sliding_window positions (itself "
        "included). Default: full causal attention.")
    dropout: Float = Field(0.0, ge=0, lt=1, description="Dropout probability on the attention weights and on "
                           "each block's attention and MLP output before the residual add; training only (off at "
                           "validation, eval and generate).")
    moe: MixtureOfExperts | None = Field(
        None, description="Mixture of experts in every block's MLP (Mixtral-style routing). Default: the dense "
        "SwiGLU MLP.")
    attention: AttentionConfig | None = Field(
        None, description="The blocks' attention: {kind: mla, kv_lora_rank, qk_rope_head_dim, q_lora_rank} for "
        "multi-head latent attention (docs/mla.md). Default: grouped-query attention.")
    time: TimeConditioning | None = Field(
        None, description="Time conditioning (StackWise's time-as-input and time-as-depth; docs/training.md, "
        "\"Time conditioning\"): a time embedding added to the token embeddings. Default: none.")

    @field_validator("attention")
    @classmethod
    def _latent_fits_the_head(cls, a, info):
        hidden, heads = info.data.get("hidden_size"), info.data.get("num_attention_heads")
        if a is None or a.kind != AttentionKind.mla or not hidden or not heads:
            return a
        if a.qk_rope_head_dim > hidden // heads:
            raise ValueError(f"qk_rope_head_dim {a.qk_rope_head_dim} is wider than a head: expected at most head_dim "
                             f"{hidden // heads} (hidden_size / num_attention_heads), got {a.qk_rope_head_dim}")
        return a

    @model_validator(mode="after")
    def _decoupled_fits(self):
        d = self.decoupled_attention
        if self.sliding_window is not None and self.family != ModelFamily.mistral:
            raise ValueError(f"sliding_window is a mistral key: expected family mistral, got {self.family.value}")
        yarn = self.rope_scaling is not None and self.rope_scaling.rope_type == RopeType.yarn
        if d is not None and (self.family != ModelFamily.llama or yarn):  # yarn scales the whole head's scores
            raise ValueError("decoupled_attention is built on the llama block: expected family llama without yarn "
                             f"RoPE scaling, got family {self.family.value}, rope_scaling {self.rope_scaling}")
        if d is not None:
            hd = self.hidden_size // self.num_attention_heads
            if d.geo_dim % 2:
                raise ValueError(f"decoupled_attention.geo_dim must be even (RoPE rotates pairs), got {d.geo_dim}")
            if d.sem_dim + d.geo_dim > hd:
                raise ValueError(f"decoupled_attention.sem_dim + geo_dim is {d.sem_dim + d.geo_dim}, more than "
                                 f"head_dim {hd}: the bottleneck must be at most a head wide")
        return self

    @property
    def mla(self) -> AttentionConfig | None:
        """The latent attention's settings when ``attention.kind`` is mla, else None."""
        a = self.attention
        return a if a is not None and a.kind == AttentionKind.mla else None

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head, the one definition every module reads. C-ARCH-001 refuses a
        hidden_size that heads do not divide, so the floor loses nothing in a valid config."""
        return self.hidden_size // self.num_attention_heads


def _from_scratch_only(value: object) -> object:
    # A path here used to be accepted and ignored (the run trained from scratch); initial weights
    # are named by `model.init_from` instead.
    if value not in (".", None):
        raise ValueError(
            'loading initial weights from model.path is not supported: expected "." (train from scratch), '
            f"got {value!r}. To start from other weights set model.init_from to a Hugging Face LLaMA folder or "
            "an apr checkpoint (docs/finetuning.md); to continue a run, keep its output_dir and use "
            "`apr train apply CONFIG --resume latest` (or --resume CHECKPOINT.json)")
    return "." if value is None else value


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_TARGET_SETS = {"attention": ATTENTION_MODULES, "mlp": MLP_MODULES, "all": ATTENTION_MODULES + MLP_MODULES}


def _lora_targets(value: object) -> object:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"expected attention, mlp, all or a list of module names, got {value!r}")
    if isinstance(value, str) and value in LORA_TARGET_SETS:
        return value
    valid = ATTENTION_MODULES + MLP_MODULES
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} match no layer of the model: expected attention, mlp, all or "
                         f"names from {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA targets list a module twice: {names}")
    return names


class TrunkDtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    nf4 = "nf4"


class LoraConfig(_Section):
    """Low-rank adapters (LoRA) on the blocks' linear layers; everything else is frozen."""

    rank: PositiveCount = Field(description="Rank r of each adapter (B @ A, A: r x in, B: out x r).")
    alpha: Float = Field(16.0, gt=0, description="Adapter scale numerator: scaling = alpha / rank "
                         "(alpha / sqrt(rank) with rslora).")
    dropout: Float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (training only).")
    targets: Annotated[str | list[str], BeforeValidator(_lora_targets)] = Field(
        "attention", description="Layers that get adapters: attention (q/k/v/o_proj), mlp (gate/up/down_proj), "
        "all, or a list of those names.")
    rslora: Bool = Field(False, description="Rank-stabilised scaling alpha / sqrt(rank) (Kalajdzievski, 2023).")
    trunk_dtype: TrunkDtype = Field(
        TrunkDtype.fp32, description="Storage of the frozen blocks' projection weights: fp32, bf16 (half the "
        "frozen memory; needs mixed_precision bf16; export merges onto the bf16-rounded weights), or nf4 (QLoRA: "
        "4-bit NormalFloat with double-quantized scalers through torchao, about 0.52 bytes a weight; any "
        "mixed_precision; quantized from model.init_from's weights at every start, so a resume needs no stored "
        "base; export merges onto the dequantized NF4 weights).")

    @property
    def modules(self) -> tuple[str, ...]:
        """The targeted projections, in the order they sit in a block."""
        names = LORA_TARGET_SETS[self.targets] if isinstance(self.targets, str) else self.targets
        return tuple(n for n in ATTENTION_MODULES + MLP_MODULES if n in names)

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


class StackInit(StrEnum):
    copy_top = "copy_top"
    interpolate = "interpolate"
    fresh = "fresh"


class StackEarlier(StrEnum):
    train = "train"
    freeze = "freeze"


class StackBuilding(StrEnum):
    append = "append"
    prepend = "prepend"


class StackPrecision(StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    nf4 = "nf4"
    nvfp4 = "nvfp4"


class TrunkStrategy(StrEnum):
    frozen = "frozen"
    qlora = "qlora"


class StageAdapters(_Section):
    """The trunk adapters of the blocks one stage adds (StackWise's per-stack ``qlora_configs``)."""

    rank: PositiveCount | None = Field(None, description="Their rank. Default: the trunk adapters' rank (after "
                                       "adapter_pattern).")
    alpha: Float | None = Field(None, gt=0, description="Their alpha. Default: the trunk adapters' alpha (after "
                                "adapter_pattern).")


class AdapterGrowth(StrEnum):
    constant = "constant"
    increasing = "increasing"
    decreasing = "decreasing"


class AdapterPattern(_Section):
    """How the trunk adapters' rank and alpha change with the stage that added a block (StackWise's
    qlora_strategy progressive with qlora_rank_pattern / qlora_alpha_pattern)."""

    rank: AdapterGrowth = Field(AdapterGrowth.constant, description="constant, increasing (the blocks stage k "
                                "added get rank x 2^k: 16, 32, 64...) or decreasing (rank / 2^k, at least 1).")
    alpha: AdapterGrowth = Field(AdapterGrowth.constant, description="The same choice for alpha.")


class StackStage(_Section):
    """One stage of progressive stacking: the model's depth and how long it trains at that depth."""

    blocks: PositiveCount = Field(description="Decoder blocks during this stage.")
    steps: PositiveCount | None = Field(
        None, description="Optimizer steps of this stage. Only the last stage may leave it out: it runs to "
        "the end of the run.")
    precision: StackPrecision = Field(
        StackPrecision.fp32, description="Storage of the projection weights of the blocks this stage adds, once a "
        "later stage freezes them (earlier: freeze): fp32, fp16, bf16, or nf4 (4-bit NormalFloat through torchao). "
        "nvfp4 is refused: no device apr runs on has an NVFP4 trunk path. The stage that adds blocks trains "
        "them in fp32.")
    adapters: StageAdapters | None = Field(
        None, description="The rank and alpha of the trunk adapters the blocks this stage adds carry once a later "
        "stage freezes them (StackWise's per-stack qlora_configs); not on the last stage, whose blocks never join "
        "the trunk. Needs trunk adapters. Default: the trunk adapters' own (after adapter_pattern).")


class ProgressiveLora(_Section):
    """StackWise's progressive QLoRA: one more adapter on every trunk block at each later grow."""

    rank: PositiveCount = Field(description="Rank of each progressive adapter (StackWise's progressive_qlora_rank, "
                                "e.g. 8 beside trunk adapters of 16).")
    alpha: Float = Field(16.0, gt=0, description="Its scale numerator: scaling = alpha / rank "
                         "(progressive_qlora_alpha).")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class StackingConfig(_Section):
    """Progressive stacking: train a shallow model, then grow it block-wise (docs/training.md)."""

    stages: list[StackStage] = Field(
        min_length=1, description="Depths in order, each deeper than the one before; the last equals "
        "model.architecture.num_hidden_layers.")
    init: StackInit = Field(StackInit.copy_top, description="New blocks: copy_top (copies of the top block), "
                            "interpolate (every block repeated in place: block i of the new stack is block "
                            "floor(i x old / new) of the old), or fresh (random init).")
    earlier: StackEarlier = Field(StackEarlier.train, description="Blocks that existed before a stage: train on, "
                                  "or freeze (no update; embedding, final norm and head still train).")
    building_mode: StackBuilding = Field(
        StackBuilding.append, description="Where a stage's new blocks go: append (above the existing ones, "
        "below the final norm) or prepend (below them, next to the embedding; the existing blocks move up "
        "unchanged). prepend takes init copy_top or fresh (interpolate moves every block).")
    trunk_lora: LoraConfig | None = Field(
        None, description="LoRA adapters on the earlier blocks (the trunk; needs earlier: freeze): from the stage "
        "after a block's own, its weights stay frozen and its adapters train, while the new stack, the embedding, "
        "the final norm and the head train in full. Each block keeps its own adapters through later stages; "
        "export merges them. trunk_dtype is not used here (stages[].precision is). Default: no adapters.")
    trunk_strategy: TrunkStrategy = Field(
        TrunkStrategy.frozen, description="frozen: the trunk in each stage's precision; qlora: the trunk's projection "
        "weights in NF4 (torchao) with the adapters of trunk_lora (default rank 16, alpha 32 on every projection, "
        "StackWise's qlora_rank / qlora_alpha). Needs earlier: freeze.")
    freeze_embedding: Bool = Field(
        False, description="With earlier: freeze, freeze the embedding too from stage 1 on (StackWise's frozen "
        "trunk): no gradient is computed below the new stack. Needs untied embeddings.")
    cache_activations: Bool = Field(
        False, description="Compute the frozen trunk's output (embedding and earlier blocks) once per training "
        "row and train the new stack on it (a verified, memory-mapped cache under <output_dir>/.apr/trunk-cache/, "
        "filled as rows are first seen). Needs earlier: freeze, freeze_embedding, building_mode append and a "
        "trunk without adapters.")
    progressive_lora: ProgressiveLora | None = Field(
        None, description="Progressive QLoRA (StackWise): when a stage adds a stack, every block that already "
        "carries trunk adapters gets one more adapter of this rank on the same projections (lora_B zero, so the "
        "grow changes nothing); earlier adapters keep training. Needs trunk adapters (trunk_lora, model.lora or "
        "trunk_strategy qlora). Export merges every adapter. Default: one adapter per trunk block.")
    adapter_pattern: AdapterPattern | None = Field(
        None, description="Trunk adapters whose rank and alpha grow or shrink with the stage that added each block "
        "(StackWise's progressive qlora_strategy): the blocks stage k added get rank x 2^k (increasing) or rank / "
        "2^k (decreasing); stages[].adapters overrides one stage. Needs trunk adapters. Default: every trunk block "
        "the same adapters.")
    # the key the trunk's adapters were given under (model.lora moves here: ModelConfig)
    _trunk_lora_key: tuple = PrivateAttr(("model", "stacking", "trunk_lora"))


class ModelConfig(_Section):
    path: Annotated[str, BeforeValidator(_from_scratch_only)] = Field(
        ".", description='Only "." (train from scratch, randomly initialised). Start from trained weights '
                         "with init_from; continue a run with `--resume`.")
    init_from: str | None = Field(
        None, description="Initial weights: a local Hugging Face folder of model_type llama, mistral or qwen2 "
        "(config.json + model.safetensors or a sharded model.safetensors.index.json; no .bin) or an apr checkpoint "
        "(.json, or a run folder: its newest). From a Hugging Face folder, model.architecture may be left out (its "
        "keys come from config.json); every key set must agree with the source (the plan names each difference). "
        "Default: random init from training.seed.")
    lora: LoraConfig | None = Field(
        None, description="Train low-rank adapters on a frozen base (needs init_from). With model.stacking: the "
        "adapters of the trunk blocks, as model.stacking.trunk_lora (the same keys; set one of the two). "
        "Default: train every weight.")
    mode: ModelMode = Field(ModelMode.transformer, description="Model family. Only transformer for now.")
    stacking: StackingConfig | None = Field(
        None, description="Progressive stacking: grow the model through stages of increasing depth. Default: "
        "train at full depth from the first step.")
    architecture: Architecture = Field(description="The model's shapes. With model.init_from naming a Hugging Face "
                                       "folder, every key left out is read from its config.json.")

    @model_validator(mode="before")
    @classmethod
    def _architecture_from_init_from(cls, data):
        """With model.init_from naming a Hugging Face folder, model.architecture's keys default to its
        config.json's (the keys set here win; the plan refuses one that contradicts the weights)."""
        if not isinstance(data, dict) or not isinstance(data.get("init_from"), str):
            return data
        given = data.get("architecture")
        if given is not None and not isinstance(given, dict):
            return data
        found = folder_architecture(data["init_from"])
        if found is None:
            if given is None:
                raise ValueError(f"model.architecture is missing and model.init_from {data['init_from']!r} is no "
                                 "Hugging Face folder with a config.json to read it from: expected model.architecture, "
                                 "or init_from naming such a folder")
            return data
        cfg_path, fields, problem = found
        if problem is not None:
            if any(k not in (given or {}) for k in REQUIRED_ARCH_KEYS):  # nothing to build the model from
                raise ValueError(f"model.init_from: {problem}; expected a folder apr imports, or every "
                                 "model.architecture key")
            return data  # the plan names the problem at model.init_from
        return {**data, "architecture": {**fields, **(given or {})}}

    @model_validator(mode="after")
    def _lora_on_standard_attention(self):
        if self.lora is not None and self.architecture.decoupled_attention is not None:
            raise ValueError("lora targets the standard projections (q_proj, k_proj, ...): it cannot be combined "
                             "with architecture.decoupled_attention")
        return self

    @model_validator(mode="after")
    def _lora_of_a_stacked_run(self):
        """On a stacked run, model.lora is the trunk's adapters (docs/design.md, "StackWise
        progressive stacks", LoRA on a stacked run): it moves to stacking.trunk_lora, so the rest
        of apr sees one key. Both set with different values stay as they are (validate names both)."""
        st = self.stacking
        if st is not None and self.architecture.family == ModelFamily.qwen2:
            raise ValueError("model.stacking's trunk stores bias-free projections: expected family llama or mistral, "
                             "got qwen2 (q/k/v biases)")
        if st is not None and self.lora is not None and st.trunk_lora in (None, self.lora):
            st.trunk_lora, self.lora = self.lora, None
            st._trunk_lora_key = ("model", "lora")
        return self


# ----------------------------------------------------------------------------------------- data


SOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def _source_name(value: object) -> object:
    if not isinstance(value, str) or not SOURCE_NAME_RE.match(value):
        raise ValueError(f"expected a source name of 1-64 letters, digits, '_' and '-', starting with a letter "
                         f"or digit, got {value!r}")
    return value


SourceName = Annotated[str, BeforeValidator(_source_name)]


class DataSource(_Section):
    """One source of a data mixture (docs/data.md, "Mixtures and stages")."""

    name: SourceName = Field(description="The source's name: in stages' weights, records and the monitor.")
    path: str = Field(description="Folder (or file) of the source's pretokenized Parquet shards.")
    weight: Float = Field(1.0, ge=0, description="Share of the mixture (normalised over the sources; in "
                          "data.weight_unit). Used when data.stages is not given.")
    val: str | None = Field(None, description="The source's own validation shards: val_loss/<name> is "
                            "recorded at every evaluation.")


class WeightUnit(StrEnum):
    tokens = "tokens"
    documents = "documents"


def _stage_start(value: object) -> object:
    if isinstance(value, bool) or (isinstance(value, int) and abs(value) > MAX_COUNT):
        raise ValueError(f"expected a step (integer up to {MAX_COUNT:,}) or a fraction of the run in [0, 1), "
                         f"got {value!r}")
    return value


class DataStage(_Section):
    """One stage of a mixture: its weights from its start step to the next stage's."""

    name: str | None = Field(None, description="A label for records and the plan (default stage<i>).")
    start: Annotated[int | float, BeforeValidator(_stage_start)] = Field(
        0, description="First step of the stage: a step (integer) or a fraction of "
                               "the run in [0, 1) (floored to a step). The first stage starts at 0.")
    weights: dict[str, Float] = Field(description="Source name -> weight (in data.weight_unit); sources not "
                                      "named get weight 0 in this stage.")


def _train(value: object) -> object:
    if not isinstance(value, (str, list)):
        kind = "a mapping" if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"expected a path, or a list of sources (name, path, weight), got {kind}")
    return value


class DataDriftConfig(_Section):
    """The plan's check that validation (and each source's validation) is drawn from the distribution
    it is meant to measure (docs/data.md, "Drift between datasets")."""

    enabled: Bool = Field(True, description="Compare train and val samples in `apr train plan`.")
    sample_tokens: PositiveCount = Field(
        250_000, description="Tokens sampled from each dataset (whole rows, from random row groups holding four "
        "times as many, at most 32).")
    psi_warning: Float = Field(
        0.25, gt=0, description="Population stability index at or above which the plan warns (0.1 is a moderate "
        "shift, 0.25 a large one).")
    ks_warning: Float = Field(
        0.2, gt=0, le=1, description="Kolmogorov-Smirnov statistic (largest gap between the two CDFs) at or above "
        "which the plan warns.")
    seed: Annotated[int, BeforeValidator(_seed)] = Field(
        0, ge=0, le=MAX_SEED, description="Seed of the sample (0 to 2**63 - 1).")


class DataConfig(_Section):
    train: Annotated[str | list[DataSource], BeforeValidator(_train)] = Field(
        description="Folder (or file) of pretokenized Parquet shards for training, or a list of named sources "
        "(name, path, weight, val) mixed by weight (docs/data.md, \"Mixtures and stages\").")
    weight_unit: WeightUnit = Field(
        WeightUnit.tokens, description="Unit of the mixture weights: tokens (a weight is the share of training "
        "tokens) or documents (the share of documents; converted with each source's tokens per document from "
        "its pretokenize manifest).")
    stages: list[DataStage] | None = Field(
        None, description="Stages of the mixture, each with its own weights and start (step or fraction of the "
        "run). Default: one stage with the sources' weights.")
    repeat: Bool = Field(
        True, description="A mixture source read to its end starts its next epoch (true) or the plan refuses a "
        "run that would exhaust it (false).")
    val: str | None = Field(None, description="Folder (or file) of Parquet shards for validation.")
    batch_size: FittedCount = Field(
        description="Micro-batch: sequences per forward/backward per device; auto: the plan fits it (with "
        "data.global_batch_size; docs/plan.md, \"auto keys\").")
    global_batch_size: PositiveCount | None = Field(
        None, description="Sequences per optimizer step over all ranks (batch_size x gradient_accumulation x "
        "world_size), kept by the plan's fit; needed when batch_size or gradient_accumulation is auto. Null: "
        "their product.")
    seq_len: PositiveCount = Field(description="Tokens per training sequence (rows hold seq_len + 1).")
    tokenizer: str | None = Field(None, description="tokenizer.json (Hugging Face tokenizers format).")
    input_column: str = Field("input_ids", description="Parquet column holding list<uint32> token ids.")
    shuffle: Bool = Field(True, description="Shuffle rows each epoch (deterministically from the seed).")
    drift: DataDriftConfig = Field(default_factory=DataDriftConfig)

    @property
    def sources(self) -> list[DataSource] | None:
        """The mixture's sources; None for a single ``data.train`` path."""
        return None if isinstance(self.train, str) else list(self.train)

    def train_paths(self) -> list[tuple[str, str]]:
        """(key path, path) of every training input: ``data.train`` or each ``data.train[i].path``."""
        if isinstance(self.train, str):
            return [("data.train", self.train)]
        return [(f"data.train[{i}].path", s.path) for i, s in enumerate(self.train)]

    def val_paths(self) -> list[tuple[str, str]]:
        """(key path, path) of every validation input: ``data.val`` and each source's ``val``."""
        out = [("data.val", self.val)] if self.val else []
        return out + [(f"data.train[{i}].val", s.val) for i, s in enumerate(self.sources or []) if s.val]


# ------------------------------------------------------------------------------------ optimizer


class OptimizerName(StrEnum):
    adamw = "adamw"
    sgd = "sgd"
    swats = "swats"
    lion = "lion"
    adafactor = "adafactor"


class OptimizerConfig(_Section):
    name: OptimizerName = Field(
        OptimizerName.adamw, description="adamw; sgd (momentum beta1, in AdamW's first-moment buffer); swats "
        "(AdamW, then SGD once the SWATS learning-rate estimate settles, per optimizer group; docs/training.md "
        "\"SWATS\"); lion (sign of the beta1 interpolation, momentum beta2: one moment); adafactor "
        "(torch.optim.Adafactor: row and column second-moment statistics, no first moment; lr caps its "
        "relative step). sgd, swats and lion run on either gradient source, adafactor on autograd only "
        "(training.engine: standard); under training.sharding all but adafactor.")
    adafactor_beta2_decay: Float = Field(
        -0.8, le=0, description="adafactor: the second-moment decay is 1 - step^beta2_decay.")
    adafactor_eps1: Float | None = Field(
        None, ge=0, description="adafactor: floor of the second-moment estimate (squared). Default: the "
        "weights' dtype epsilon.")
    adafactor_eps2: Float = Field(
        1.0e-3, ge=0, description="adafactor: floor of a weight's RMS in its relative step size.")
    adafactor_clip_threshold: Float = Field(
        1.0, ge=1, description="adafactor: an update whose RMS exceeds this is scaled down to it.")
    swats_min_steps: NonNegCount = Field(
        100, description="swats: AdamW steps before a group may switch to SGD.")
    swats_tolerance: Float = Field(
        1.0e-9, gt=0, description="swats: a group switches when its bias-corrected SGD learning-rate estimate "
        "is within this of the step's own estimate.")
    lr: Float = Field(3.0e-4, gt=0, le=1e3, description="Peak learning rate.")
    min_lr: Float | None = Field(None, ge=0, description="Floor of the schedule. Default: 10% of lr.")
    beta1: Float = Field(0.9, ge=0, lt=1, description="First-moment decay (adamw, swats, sgd's momentum); lion: "
                         "the weight of the momentum against the gradient in the signed step.")
    beta2: Float = Field(0.95, ge=0, lt=1, description="Second-moment decay (adamw, swats); lion: the momentum's "
                         "decay (the Lion paper uses 0.99).")
    eps: Float = Field(1.0e-8, gt=0)
    weight_decay: Float = Field(0.1, ge=0, description="Decoupled weight decay (not applied to norms).")
    decay_embeddings: Bool = Field(False, description="Apply weight decay to the embedding matrix too.")

    @property
    def resolved_min_lr(self) -> float:
        # 15 significant digits: 3e-4 * 0.1 is 3e-05 here, not 2.9999999999999997e-05 in every plan
        return float(f"{self.lr * 0.1:.15g}") if self.min_lr is None else self.min_lr


# ------------------------------------------------------------------------------------- training


class TrainingMode(StrEnum):
    causal_lm = "causal_lm"
    distill = "distill"
    mlm = "mlm"
    custom = "custom"  # targets from a column of the data (training.custom)


class CustomObjective(_Section):
    """StackWise's custom objective (training.mode: custom; docs/training.md, "Custom targets"): the
    targets are a column of the Parquet data beside the token ids."""
    targets_column: str = Field("targets", min_length=1, description="Parquet column of list<int32> targets, as "
                                "long as the token rows (seq_len + 1): input position i is trained to predict "
                                "entry i + 1 (so the ids themselves give the causal LM); -100 adds no loss.")


class MlmConfig(_Section):
    """The masked-LM objective (training.mode: mlm; docs/training.md, "Masked-LM objective")."""
    mask_rate: Float = Field(0.15, gt=0, lt=1, description="Share of input positions replaced by mask_token_id; "
                             "the loss is the cross-entropy at those positions only.")
    mask_token_id: NonNegCount = Field(description="Token id that replaces a masked position (below "
                                       "model.architecture.vocab_size).")


class BlockLoss(StrEnum):
    l1 = "l1"
    mse = "mse"
    cosine = "cosine"


class AutotuneMode(StrEnum):
    off = "off"
    monitor = "monitor"
    active = "active"


class AutotuneConfig(_Section):
    """Per-block LR autotune of distillation's phase 1 (docs/training.md, "Blockwise distillation")."""

    mode: AutotuneMode = Field(AutotuneMode.off, description="off; monitor (record spikes and plateaus of each "
                               "block's loss and what active mode would do); active (also lower that block's LR).")
    spike_factor: Float = Field(2.0, gt=1, description="A step whose block loss exceeds this x the block's loss "
                                "EMA is a spike.")
    plateau_patience: PositiveCount = Field(50, description="Steps of a block without a new best loss (by "
                                            "min_delta) before it is a plateau.")
    min_delta: Float = Field(0.01, ge=0, lt=1, description="A new best must be below best x (1 - min_delta).")
    lr_decay: Float = Field(0.5, gt=0, lt=1, description="active: the block's LR factor is multiplied by this "
                            "on a spike or a plateau.")
    min_lr_factor: Float = Field(0.01, gt=0, le=1, description="active: the block's LR factor never goes below "
                                 "this.")
    ema_beta: Float = Field(0.9, gt=0, lt=1, description="Decay of the block loss EMA.")


class VerifyLimits(_Section):
    """Largest allowed differences between student and teacher outputs (docs/eval.md, "apr verify")."""

    max_mean_l1: Float = Field(0.05, gt=0, description="Largest allowed mean absolute difference.")
    max_max_l1: Float = Field(0.25, gt=0, description="Largest allowed absolute difference of any element.")


class VerifyConfig(_Section):
    """Compare student and teacher at the end of training, as `apr verify` does."""

    batches: PositiveCount = Field(5, description="Batches of data.val (else data.train) to compare on.")
    attention: VerifyLimits = Field(default_factory=VerifyLimits, description="Per student block: its "
                                    "attention output (a block mapped to several teacher blocks: its output).")
    logits: VerifyLimits = Field(default_factory=VerifyLimits, description="The whole models' logits.")


class DistillConfig(_Section):
    """Blockwise distillation from a teacher (training.mode: distill)."""

    teacher: str = Field(description="The teacher: an apr checkpoint (.json, or a run folder: its newest) or a "
                         "local Hugging Face LLaMA folder (config.json + safetensors).")
    block_map: list[list[BlockIndex]] | None = Field(
        None, description="Per student block, the teacher blocks [start, end) it learns to reproduce; they must "
        "cover the teacher's blocks in order. Default: teacher blocks split evenly (teacher depth a multiple "
        "of the student's).")
    phase1_steps: NonNegCount = Field(
        100, description="Phase 1 optimizer steps per student block (block 0 first). 0 skips phase 1.")
    block_loss: BlockLoss = Field(BlockLoss.mse, description="Phase 1 loss between the student block's output "
                                  "and the teacher's: l1 (mean absolute difference), mse, or cosine (1 - cosine "
                                  "similarity per position).")
    convergence_target: Float | None = Field(
        None, gt=0, description="Phase 1 ends a block early once a step's block loss is at or below this (the "
        "block has converged). Default: no target.")
    convergence_patience: PositiveCount | None = Field(
        None, description="Phase 1 ends a block early after this many steps without a new best block loss. "
        "Default: never.")
    convergence_max_steps: PositiveCount | None = Field(
        None, description="With convergence_target or convergence_patience: the most steps a block trains "
        "(default phase1_steps); phase 2 starts when the last block ends.")
    cache_teacher_outputs: Bool = Field(
        False, description="Phase 1 reads the teacher's block inputs and outputs from a checksummed, "
        "memory-mapped cache ($APR_HOME/cache/teacher), computed once per training row and reused across "
        "blocks, runs and resumes; a damaged part is recomputed, a full disk turns it off for the run.")
    temperature: Float = Field(2.0, gt=0, description="Phase 2 softmax temperature of the KL to the teacher.")
    kd_weight: Float = Field(0.5, ge=0, le=1, description="Phase 2 loss = kd_weight x T^2 x KL(teacher || "
                             "student) + (1 - kd_weight) x cross-entropy.")
    init_from_teacher: Bool = Field(True, description="Start the student from the teacher: its embedding, final "
                                    "norm, head and, for each student block, the first teacher block it maps to.")
    autotune: AutotuneConfig = Field(default_factory=AutotuneConfig)
    verify: VerifyConfig | None = Field(None, description="Compare student and teacher when the run finishes "
                                        "(a verify event, verify.json in the output folder). Default: off.")


class LRScheduler(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"


class MixedPrecision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class StateDtype(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"


class ClipMode(StrEnum):
    global_norm = "global"
    per_block = "per_block"
    adagc = "adagc"


_ACTIVATIONS_RE = re.compile(r"^(auto|keep|selective|recompute|keep_first:[0-9]+)$")


def _activations(value: object) -> object:
    if not isinstance(value, str) or not _ACTIVATIONS_RE.match(value):
        raise ValueError(f"expected auto, keep, keep_first:K (K a block count), selective or recompute, got {value!r}")
    return value


ActivationsPolicy = Annotated[str, BeforeValidator(_activations),
                              WithJsonSchema({"type": "string", "pattern": _ACTIVATIONS_RE.pattern})]


class GradientsPolicy(StrEnum):
    auto = "auto"
    kept = "kept"
    workspace = "workspace"


def _compile_setting(value: object) -> object:
    if isinstance(value, bool) or value == "auto":
        return value
    raise ValueError(f"expected true, false or auto, got {value!r}")


CompileSetting = Annotated[bool | str, BeforeValidator(_compile_setting),
                           WithJsonSchema({"anyOf": [{"type": "boolean"}, {"const": "auto"}]})]


class ExecutionConfig(_Section):
    """What the interleaved engine keeps and what it recomputes (docs/training.md, "Execution")."""

    activations: ActivationsPolicy = Field(
        "auto", description="auto (the plan picks the fastest that fits the memory budget), keep (every "
        "block's autograd graph, no recompute), keep_first:K (the first K blocks kept, the rest recomputed), "
        "selective (keep matmul and attention outputs, recompute norms, activations, rope) or recompute "
        "(only each block's input kept).")
    gradients: GradientsPolicy = Field(
        GradientsPolicy.auto, description="auto, kept (every group's gradient for the whole step: global "
        "clipping costs no extra walk) or workspace (one shared buffer of the largest group's size).")
    compile: CompileSetting = Field(
        "auto", description="torch.compile each decoder block: true (needs a working compiler), false, or auto "
        "(the plan compiles when the steps saved repay the compile time: device, step time, run length; "
        "docs/training.md, \"Compiled blocks\").")


class AdaGCConfig(_Section):
    """Adaptive per-tensor gradient clipping (clip_mode: adagc)."""

    beta: Float = Field(0.98, gt=0, lt=1, description="EMA decay of each tensor's clipped gradient norm.")
    threshold: Float = Field(1.05, gt=0, description="Clip a tensor's gradient to threshold x its norm EMA.")
    warmup_steps: NonNegCount = Field(
        100, description="Steps clipping each tensor to grad_clip (absolute) while the EMAs settle.")


class EarlyStoppingConfig(_Section):
    """End the run when the validation loss stops improving (needs data.val and training.eval_interval)."""

    patience: PositiveCount | None = Field(
        None, description="Validations in a row without an improvement of min_delta that end the run; "
        "null disables early stopping.")
    min_delta: Float = Field(0.0, ge=0, description="How much lower than the best so far a validation "
                             "loss must be to count as an improvement.")


class BadStepsConfig(_Section):
    """Skip an optimizer step whose loss or gradient norm is an outlier against the run's recent
    history (a z-score test; docs/training.md "Bad-step skipping")."""

    loss_z: Float | None = Field(
        None, gt=0, description="Skip a step whose loss is this many standard deviations above its running "
        "mean; null: no loss test.")
    grad_norm_z: Float | None = Field(
        None, gt=0, description="Skip a step whose gradient norm is this many standard deviations above its "
        "running mean; null: no gradient-norm test (with one gradient workspace and no global clipping it "
        "adds a norm-only backward walk: the norm must be known before the first update).")
    window: PositiveCount = Field(
        100, description="Span in steps of the running mean and variance (an EMA over the steps not skipped).")
    min_history: PositiveCount = Field(
        20, description="Steps recorded before any step is tested (the statistics settle first).")


class RollbackConfig(_Section):
    """Roll back to the last good checkpoint on a loss spike that persists, skipping the spike's data
    (docs/training.md "Spike rollback")."""

    threshold: Float | None = Field(
        None, gt=1, description="A step whose loss is above threshold x the EMA of the loss is a spike step; "
        "null disables rollback.")
    patience: PositiveCount = Field(3, description="Spike steps in a row that trigger a rollback.")
    window: PositiveCount = Field(50, description="Span in steps of the loss EMA (over steps that are not spikes).")
    min_history: PositiveCount = Field(20, description="Steps recorded before spikes are tested.")
    max_rollbacks: PositiveCount = Field(
        3, description="Rollbacks a run may make; the next persistent spike stops it (status failed).")
    lr_factor: Float = Field(
        1.0, gt=0, le=1, description="After a rollback, multiply the learning rate by this for lr_steps steps.")
    lr_steps: NonNegCount = Field(0, description="Steps the lowered learning rate lasts after a rollback.")


class StrategyClip(StrEnum):
    run = "run"
    global_norm = "global"
    per_block = "per_block"
    adagc = "adagc"
    off = "off"


class StrategyOptimizer(StrEnum):
    adamw = "adamw"
    sgd = "sgd"


class StrategyConfig(_Section):
    """One optimization strategy the orchestrator may switch to (training.orchestrator.strategies)."""

    optimizer: StrategyOptimizer = Field(
        StrategyOptimizer.adamw, description="adamw, or sgd (momentum beta1 in AdamW's first-moment buffer).")
    lr_factor: Float = Field(1.0, gt=0, description="Multiplies the schedule's learning rate.")
    beta1: Float | None = Field(None, ge=0, lt=1, description="AdamW beta1 / SGD momentum; null: optimizer.beta1.")
    beta2: Float | None = Field(None, ge=0, lt=1, description="AdamW beta2; null: optimizer.beta2.")
    clip_mode: StrategyClip = Field(
        StrategyClip.run, description="run (training.clip_mode), global, per_block, adagc (needs training."
        "clip_mode: adagc: its EMAs are allocated with the engine) or off.")
    clip_factor: Float = Field(1.0, gt=0, description="Multiplies training.grad_clip (the clipping threshold; "
                               "a run without grad_clip does not clip).")
    weight_decay: Float | None = Field(None, ge=0, description="Decoupled weight decay; null: optimizer.weight_decay.")


class NowcastConfig(_Section):
    """Weight nowcasting: a linear fit of each tensor's trajectory over the last decision points,
    jumped ahead and kept only when validation improves (a branch like any other)."""

    enabled: Bool = Field(False, description="Try a nowcast jump at each decision point.")
    history: PositiveCount = Field(
        3, ge=2, le=16, description="Decision-point weight states the fit reads (each a copy of the weights).")
    ahead: PositiveCount | None = Field(
        None, description="Steps the jump extrapolates; null: decision_interval.")


class OrchestratorConfig(_Section):
    """Orchestrated training: switch the optimization strategy from telemetry while the run trains
    (docs/training.md "Orchestrated training")."""

    enabled: Bool = Field(False, description="Orchestrate this run.")
    decision_interval: PositiveCount = Field(500, description="Steps between decision points.")
    eval_horizon: PositiveCount = Field(
        100, description="Steps each candidate strategy trains from a decision point before it is scored.")
    initial_strategy: str = Field("conservative_adamw", description="The strategy before the first decision.")
    strategies: dict[str, StrategyConfig] = Field(
        default_factory=dict, description="Strategies of your own (name -> strategy), beside the built-in "
        "conservative_adamw, aggressive_adamw, sgd_escape and spike_resistant (a built-in's name redefines it).")
    candidates: list[str] | None = Field(
        None, description="The strategies the bandit chooses among; null: every strategy.")
    branches: PositiveCount = Field(
        1, description="Candidates trained from the same state at each decision point (speculative branching, "
        "exact); 1: the bandit's pick trains on, no branch.")
    exploration: Float = Field(1.414, ge=0, description="UCB1's exploration constant c.")
    eval_batches: PositiveCount | None = Field(
        None, description="Validation micro-batches a branch is scored on (the same for every branch); null: "
        "training.eval_batches.")
    max_loss_increase: Float | None = Field(
        1.5, gt=1, description="A step whose loss exceeds this x the loss at the last decision point rolls back "
        "to that point's state (in a resumed process: the newest checkpoint at or before it) and switches to "
        "safety_strategy; null: no safety rollback.")
    safety_strategy: str = Field("spike_resistant", description="The strategy a safety rollback switches to.")
    nowcasting: NowcastConfig = Field(default_factory=NowcastConfig)


class Sharding(StrEnum):
    none = "none"
    shard_grad_op = "shard_grad_op"
    full = "full"
    hybrid = "hybrid"


class Reduction(StrEnum):
    fast = "fast"
    canonical = "canonical"


class Engine(StrEnum):
    interleaved = "interleaved"
    standard = "standard"


class KernelBackend(StrEnum):
    auto = "auto"
    cupy = "cupy"
    torch = "torch"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TrainingConfig(_Section):
    mode: TrainingMode = Field(TrainingMode.causal_lm, description="Objective: causal_lm, distill "
                               "(blockwise distillation from training.distill.teacher, then KD fine-tuning), "
                               "mlm (masked LM with bidirectional attention; training.mlm) or custom (targets "
                               "from a column of the data; training.custom).")
    distill: DistillConfig | None = Field(None, description="Blockwise distillation (needs mode: distill).")
    mlm: MlmConfig | None = Field(None, description="The masked-LM objective (needs mode: mlm).")
    custom: CustomObjective | None = Field(None, description="Targets from the data (needs mode: custom).")
    epochs: PositiveCount = Field(1, description="Passes over the training data; caps the step count.")
    max_steps: PositiveCount | None = Field(
        None, description="Optimizer steps to run. Default: epochs x steps_per_epoch."
    )
    warmup_steps: NonNegCount = Field(0, description="Linear warmup from 0 to lr.")
    lr_scheduler: LRScheduler = Field(LRScheduler.cosine, description="Shape after warmup.")
    decay_fraction: Float = Field(
        0.2, gt=0, le=1, description="wsd only: the final fraction of steps spent decaying to min_lr."
    )
    decay_stage: str | None = Field(
        None, description="wsd only: start the decay where this data stage (data.stages[].name) starts, "
        "instead of decay_fraction.")
    gradient_accumulation: FittedCount = Field(
        1, description="Micro-batches per optimizer step; auto: the plan fits it (with data.global_batch_size).")
    grad_clip: Float | None = Field(1.0, gt=0, description="Clip gradients to this norm; null disables.")
    clip_mode: ClipMode = Field(
        ClipMode.global_norm,
        description="global: exact global-norm clipping (one extra backward walk in the interleaved "
        "engine when gradients are not kept); per_block: clip each block's gradient on its own (free); "
        "adagc: clip each tensor against an EMA of its own gradient norm (free; see training.adagc).",
    )
    adagc: AdaGCConfig = Field(default_factory=AdaGCConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    mixed_precision: MixedPrecision = Field(MixedPrecision.bf16, description="Compute precision.")
    state_dtype: StateDtype = Field(
        StateDtype.fp32, description="Storage of the weights and AdamW moments between steps. fp32: 12 bytes a "
        "parameter (float32 masters). bf16: 6 bytes, gradients in bf16 too; each update is computed in float32 and "
        "written back with stochastic rounding (noise from the seed, step, group and element, so a resume is "
        "bitwise), which keeps updates smaller than a bf16 ulp on average. Needs mixed_precision bf16, AdamW and "
        "the flat-buffer walk in one process (docs/training.md, \"bf16 state\").")
    output_dir: FolderPath = Field("checkpoints/run", description="Run directory: checkpoints and records.")
    save_interval: PositiveCount = Field(1000, description="Checkpoint every N optimizer steps.")
    keep_last: PositiveCount = Field(1, description="Step checkpoints kept besides the best one.")
    checkpoint_async: Bool = Field(
        True, description="Write checkpoints on a background thread: training waits only for a copy of the state "
        "in host memory (one at a time); false writes them before the next step.")
    log_interval: PositiveCount = Field(10, description="Log and record metrics every N steps.")
    eval_interval: NonNegCount = Field(500, description="Validate every N steps; 0 disables.")
    eval_batches: PositiveCount = Field(20, description="Validation micro-batches per evaluation.")
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    bad_steps: BadStepsConfig = Field(default_factory=BadStepsConfig)
    rollback: RollbackConfig = Field(default_factory=RollbackConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    seed: Annotated[int, BeforeValidator(_seed)] = Field(
        42, ge=0, le=MAX_SEED, description="Seed of init, data order and dropout-free RNG use (0 to 2**63 - 1).")
    engine: Engine = Field(Engine.interleaved, description="interleaved (per-block backward+AdamW) or standard.")
    kernels: KernelBackend = Field(KernelBackend.auto, description="Fused-op backend: auto, cupy or torch.")
    device: Device = Field(Device.auto, description="Where to train: auto picks cuda when available.")
    cpu_threads: PositiveCount | None = Field(
        None, le=4096, description="torch intra-op CPU threads per process; null: the usable cores / ranks per node "
        "(APR_CPU_THREADS overrides; docs/performance.md, \"CPU threads\").")
    loss_chunk_size: PositiveCount = Field(
        256, description="Sequence positions per LM-head/cross-entropy chunk (full logits never exist)."
    )
    world_size: PositiveCount = Field(
        1, le=MAX_INDEX, description="Data-parallel processes (torchrun sets this at run time).")
    sharding: Annotated[Sharding, WithJsonSchema({"enum": [*(s.value for s in Sharding), "auto"]})] = Field(
        Sharding.none, description="Under torchrun: none (every rank holds everything, gradients all-reduced), "
        "shard_grad_op (gradients and AdamW moments sharded, ZeRO-2) or full (weights too, gathered per block "
        "for its forward and backward, ZeRO-3) or hybrid (full sharding within a node, replicas across nodes), "
        "on torch FSDP2, per decoder block, for either engine; auto: the plan fits it on several ranks (none on one).")
    reduction: Reduction = Field(
        Reduction.fast, description="How a step's micro-batch gradients are summed. fast: accumulated in order on each "
        "rank, then all-reduced (the order depends on the number of ranks: a resume on another world size ends "
        "within float rounding, not bitwise). canonical: each micro-batch's gradient kept apart and summed in one "
        "fixed tree over the global micro-batch index, so 1, 2 or 4 ranks, or one process with accumulation, "
        "give the same bits, and the validation loss too (the first eval_batches micro-batches on any layout, "
        "summed in the same tree). Costs memory and traffic beside fast, printed by validate and the plan (each "
        "micro-batch's gradient kept on its rank until a slice of it (DDP) or its shard rows (FSDP2) are sent "
        "to the rank that sums them, in an all-to-all: gradient_accumulation + 1 gradients per rank at the "
        "peak). Both gradient sources (the flat-buffer walk keeps its gradients for the step: not with "
        "training.execution.gradients: workspace), "
        "with or without training.sharding; the orchestrator's decisions and distillation's too (not with "
        "distill.cache_teacher_outputs).")
    nodes: PositiveCount = Field(
        1, le=MAX_INDEX, description="Nodes the ranks run on (the plan's per-rank memory under sharding: hybrid "
        "shards over world_size / nodes ranks). At run time torchrun's LOCAL_WORLD_SIZE decides.")
    gpu: str | None = Field(None, description="Target GPU for the plan's memory and time budget (e.g. h100).")
    vram: ByteSize = Field(None, description="Target VRAM for the plan, e.g. 24GiB (overrides gpu's).")
    price_per_gpu_hour: Float | None = Field(
        None, gt=0, strict=True,
        description="Price of one GPU for one hour (any currency): the plan's cost estimate and the live "
                    "cost in training_state.json, `apr runs show` and the monitor. `apr train plan --price` "
                    "overrides it.")


# ----------------------------------------------------------------------------------- monitoring


class ChartType(StrEnum):
    loss_curve = "loss_curve"


class ChartMetric(StrEnum):
    loss = "loss"


# the metrics the step line of `apr train apply` can show, by config name -> StepLog field
class StepLineMetric(StrEnum):
    loss = "loss"
    learning_rate = "learning_rate"
    gradient_norm = "gradient_norm"
    epoch = "epoch"
    tokens_seen = "tokens_seen"


# GPU telemetry fields the run records in training_state.json (apr.track.telemetry.gpu_snapshot)
class SystemMetric(StrEnum):
    gpu_utilization = "gpu_utilization"
    memory = "memory"
    temperature = "temperature"
    power = "power"


class ChartConfig(_Section):
    type: ChartType = Field(ChartType.loss_curve, description="Chart kind: loss_curve (the only one the "
                            "dashboard draws).")
    metric: ChartMetric = Field(ChartMetric.loss, description="Metric charted: loss (the training loss, with "
                                "the val loss beside it). Compare other metrics with `apr experiment view "
                                "--metric NAME`.")
    window: PositiveCount | None = Field(
        None, description="Smoothing window (EMA span in steps). Default: from the run's length, "
                          "total_steps / 50 between 1 and 100, so a short run's curve does not lag.")
    show_eta: Bool = True


class TerminalConfig(_Section):
    enabled: Bool = Field(True, description="Draw the progress bar of `apr train apply` on a terminal (the "
                          "step lines print either way).")
    refresh_rate: PositiveCount = Field(1000, description="Dashboard refresh period in ms.")
    metrics: list[StepLineMetric] = Field(
        default_factory=lambda: [StepLineMetric.loss, StepLineMetric.learning_rate, StepLineMetric.gradient_norm],
        description="Metrics the step line of `apr train apply` shows, in this order (tok/s and ETA always "
                    "follow): loss, learning_rate, gradient_norm, epoch, tokens_seen.")
    charts: list[ChartConfig] = Field(default_factory=lambda: [ChartConfig()])


class TrackingBackend(StrEnum):
    sqlite = "sqlite"


class TrackingConfig(_Section):
    enabled: Bool = True
    backend: TrackingBackend = TrackingBackend.sqlite
    experiment: ExperimentName = Field(
        None, description="Experiment name (1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit, no "
                          "'..'). Default: the name of training.output_dir.")
    tags: dict[str, str] = Field(default_factory=dict, description="Labels recorded with the run (shown by "
                                 "`apr runs show`, stored as params monitoring.tracking.tags.NAME).")


class SystemConfig(_Section):
    enabled: Bool = True
    interval: PositiveCount = Field(5000, description="GPU telemetry period in ms.")
    metrics: list[SystemMetric] = Field(
        default_factory=lambda: [SystemMetric.gpu_utilization, SystemMetric.memory, SystemMetric.temperature,
                                 SystemMetric.power],
        description="GPU telemetry recorded in training_state.json (and shown by the monitor): "
                    "gpu_utilization, memory, temperature, power.")


class AlertAction(StrEnum):
    stop = "stop"
    warn = "warn"


class AlertSeverity(StrEnum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"


class AlertConfig(_Section):
    condition: str = Field(description="CEL expression over the step's metrics, e.g. 'loss > 10'.")
    severity: AlertSeverity | None = Field(None, description=(
        "critical or error: stop the run after the step, with its checkpoint (docs/runs.md, Alerts); "
        "warning or info: record and show. Default: from action (stop: error, warn: warning), else warning."))
    action: AlertAction | None = Field(None, description=(
        "The older spelling: stop (= severity error) or warn (= severity warning). Give one of the two, or both "
        "when they agree."))
    message: str | None = None

    @model_validator(mode="after")
    def _severity_agrees_with_action(self):
        if self.severity is not None and self.action is not None:
            stops = str(self.severity) in severities.STOPPING_SEVERITIES
            if stops != (self.action == AlertAction.stop):
                raise ValueError(f"expected severity and action to agree, got severity {self.severity} (which "
                                 f"{'stops' if stops else 'does not stop'} the run) with action {self.action}")
        return self

    @property
    def effective_severity(self) -> str:
        return severities.severity_of(str(self.severity) if self.severity else None,
                                    str(self.action) if self.action else None)


class SinkType(StrEnum):
    tensorboard = "tensorboard"
    mlflow = "mlflow"
    wandb = "wandb"


class SinkConfig(_Section):
    """One external tracker the run's metrics are also written to (docs/runs.md, "Tracker sinks")."""

    type: SinkType = Field(description="tensorboard, mlflow or wandb (offline) (their packages: pip install "
                                       "'apr[sinks]').")
    dir: str | None = Field(None, description="tensorboard, wandb: where the files go; relative paths are relative "
                                              "to the current folder. Default: <output_dir>/tensorboard or "
                                              "<output_dir>/wandb.")
    uri: str | None = Field(None, description="mlflow: the tracking URI (sqlite:///PATH.db, http://HOST:PORT, ...). "
                                              "Default: sqlite:///<output_dir>/mlflow.db.")

    @model_validator(mode="after")
    def _keys_of_its_type(self):
        if self.dir is not None and self.type == SinkType.mlflow:
            raise ValueError("expected dir only for a tensorboard or wandb sink, got dir for mlflow (use uri)")
        if self.uri is not None and self.type != SinkType.mlflow:
            raise ValueError(f"expected uri only for an mlflow sink, got uri for {self.type}")
        return self


class DataDriftWatchConfig(_Section):
    """Drift during training (docs/monitor.md, "Data drift during training"): the rows the run has
    read so far this epoch against the rows still ahead of the loader's cursor."""

    interval: NonNegCount = Field(
        0, description="Steps between checks (0: off): data_drift_psi, data_drift_ks, data_drift_wasserstein (token "
        "ranks) and data_drift_doc_length_* in the stores, training_state.json and alert conditions.")
    sample_tokens: PositiveCount = Field(
        65_536, description="Tokens sampled (whole rows) from each side at each check.")
    seed: Annotated[int, BeforeValidator(_seed)] = Field(
        0, ge=0, le=MAX_SEED, description="Seed of the samples (mixed with the step; 0 to 2**63 - 1).")


class HistogramsConfig(_Section):
    """Per-layer weight and gradient histograms (docs/monitor.md, "Histograms")."""

    interval: NonNegCount = Field(
        0, description="Steps between histograms of every layer's weights and gradients (0: off); the latest in "
        "training_state.json (the monitor's hist panel), each in the stores' events (kind histograms).")
    bins: PositiveCount = Field(32, le=256, description="Bins per histogram; a layer's edges are fixed at its first "
                                "histogram, values beyond them counted in the end bins.")


class MonitoringConfig(_Section):
    terminal: TerminalConfig = Field(default_factory=TerminalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    system: SystemConfig = Field(default_factory=SystemConfig)
    alerts: list[AlertConfig] = Field(default_factory=list)
    block_norms: Bool = Field(True, description="Record each block's gradient and update norm (and the "
                              "embedding's and head's) at every log step: block_grad_norm, block_update_norm, ... "
                              "in the stores, training_state.json, alert conditions and the monitor (docs/monitor.md).")
    csv_log: Bool = Field(False, description="Write <output_dir>/metrics.csv as the run goes: one row per logged "
                          "or validated step (step, loss, val_loss, lr, grad_norm, tokens_per_s, tokens_seen, epoch); "
                          "a resume continues it without repeating a step (docs/runs.md).")
    drift_after_steps: NonNegCount = Field(
        20, description="Compare the run with its plan after this many steps (step time, tokens/s, peak memory on "
        "a GPU): drift_* in training_state.json, the stores and alert conditions (docs/monitor.md); 0 disables.")
    data_drift: DataDriftWatchConfig = Field(default_factory=DataDriftWatchConfig)
    histograms: HistogramsConfig = Field(default_factory=HistogramsConfig)
    sinks: list[SinkConfig] = Field(
        default_factory=list, description="External trackers fed the same metrics as the stores, each on a "
                                          "thread of its own with a bounded queue; a failing or silent one is a "
                                          "warning, never a failed or held run.")


# ------------------------------------------------------------------------------------ evaluation

BUILTIN_TASKS = ("stdlib-nextline",)  # apr.evaluate.stdlib_task.BUILTIN_TASKS (kept torch-free here)


def _task_spec(value):
    if isinstance(value, str) and (value in BUILTIN_TASKS or value.endswith(".jsonl")):
        return value
    raise ValueError(f"expected a built-in task ({', '.join(BUILTIN_TASKS)}) or a .jsonl file, got {value!r}")


TaskSpec = Annotated[str, BeforeValidator(_task_spec)]


class SamplesConfig(_Section):
    prompts: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="Prompts continued (greedy) at each task evaluation; the text is recorded.")
    max_new_tokens: PositiveCount = Field(32, description="Tokens generated per prompt.")


class EvaluationConfig(_Section):
    """Evaluation during training (docs/eval.md): multiple-choice tasks and sample generations."""

    tasks: list[TaskSpec] = Field(
        default_factory=list, description="Multiple-choice tasks scored during training: stdlib-nextline or "
        "a .jsonl file (docs/eval.md). Needs data.tokenizer.")
    interval: NonNegCount = Field(0, description="Steps between task evaluations; 0 uses training.eval_interval.")
    limit: PositiveCount = Field(50, description="Examples per task at each evaluation.")
    samples: SamplesConfig | None = Field(None, description="Sample generations at each task evaluation.")


# ------------------------------------------------------------------------------------------ root


class AprConfig(_Section):
    """A whole training config file."""

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
