"""What a checkpoint's JSON sidecar may hold, checked before anything in it is used.

A sidecar is read back from disk, where a person (or a broken disk) may have changed it. It is
bounded before parsing by ``apr.readers`` (size, nesting depth), then checked here against a
schema: the manager's own keys (step, weights file, SHA-256, size, config and its hash) for every
reader, and the trainer's state (data cursor, engine, RNG) for a resume. The recorded
``config_hash`` must be the hash of the recorded config, so an edited config (an architecture field
changed by hand) is caught here and never reaches a resume or an export. See docs/checkpoints.md,
"Loading is verified and never unpickles".
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from apr.config.loader import config_doc_hash

HEX64 = r"^[0-9a-f]{64}$"

NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]


class SidecarProblem(ValueError):
    """The sidecar cannot be used; ``reason`` is the checkpoint error reason to report."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class Head(_Strict):
    """The keys the checkpoint manager writes."""

    step: NonNegInt
    is_best: bool = False
    weights_file: str
    weights_sha256: Annotated[str, Field(pattern=HEX64)]
    weights_size: NonNegInt
    tensor_count: NonNegInt | None = None
    apr_version: str | None = None
    saved_at: str | None = None
    cwd: str | None = None
    config_hash: Annotated[str, Field(pattern=HEX64)] | None = None
    config: dict[str, Any]

    @field_validator("weights_file")
    @classmethod
    def _beside(cls, value: str) -> str:
        if not value or Path(value).name != value:
            raise ValueError("must name a file beside the JSON")
        return value


def _base64(value: str) -> str:
    try:
        base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("is not base64") from None
    return value


class _PythonRng(_Strict):
    version: int
    state: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 32)]], Field(min_length=625, max_length=625)]
    gauss_next: float | None


class _NumpyRng(_Strict):
    bit_generator: Literal["MT19937"]
    keys: str
    pos: Annotated[int, Field(ge=0, le=624)]
    has_gauss: Annotated[int, Field(ge=0, le=1)]
    cached_gaussian: float

    @field_validator("keys")
    @classmethod
    def _keys(cls, value: str) -> str:
        if len(base64.b64decode(_base64(value))) != 624 * 4:
            raise ValueError("must decode to 624 32-bit keys")
        return value


class _CudaRng(_Strict):
    device: NonNegInt
    state: str

    _state = field_validator("state")(_base64)


class RngState(_Strict):
    format_version: Literal[1]
    python: _PythonRng | None = None
    numpy: _NumpyRng | None = None
    torch_cpu: str | None = None
    torch_cuda: _CudaRng | None = None

    _cpu = field_validator("torch_cpu")(lambda v: v if v is None else _base64(v))


class DataCursor(_Strict):
    version: NonNegInt
    epoch: NonNegInt
    position: NonNegInt
    seed: int
    num_rows: NonNegInt
    batch_size: PosInt
    world_size: PosInt
    gradient_accumulation: PosInt
    shuffle: bool


class _MixtureCredit(_Strict):
    seed: int
    draws: NonNegInt
    credit: dict[str, Annotated[float, Field(allow_inf_nan=False)]]
    cursors: dict[str, Annotated[list[NonNegInt], Field(min_length=2, max_length=2)]]


class MixtureCursor(_Strict):
    """A data mixture's cursor (apr/data/mixloader.py ``state_dict``)."""

    version: NonNegInt
    kind: Literal["mixture"]
    stage: NonNegInt
    cursor: _MixtureCredit
    rows_seen: dict[str, NonNegInt]
    rows: dict[str, PosInt]
    seed: int
    rows_per_step: PosInt
    batch_size: PosInt
    world_size: PosInt
    gradient_accumulation: PosInt
    shuffle: bool
    stage_draws: list[NonNegInt]
    stage_weights: list[dict[str, float]]


class LossScaler(_Strict):
    enabled: bool
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    good_steps: NonNegInt
    skipped_steps: NonNegInt = 0


class EngineState(_Strict):
    engine: str
    optimizer_steps: NonNegInt
    loss_scaler: LossScaler


class TrainerState(_Strict):
    """The trainer's keys, at the top level of the sidecar beside the manager's."""

    data: DataCursor | MixtureCursor
    engine: EngineState
    rng: RngState
    epoch: NonNegInt | None = None
    run_id: str | None = None
    cli_overrides: dict[str, str | int | float | bool | None] | None = None
    best_val_loss: float | None = None
    first_val_loss: float | None = None
    tokens_seen: NonNegInt | float | None = None
    schedule: dict[str, Any] | None = None


_UNION_MEMBERS = {"DataCursor", "MixtureCursor"}  # pydantic names the union member it tried: not a key


def _problems(err: ValidationError, limit: int = 3) -> str:
    parts = []
    for e in err.errors()[:limit]:
        where = ".".join(str(p) for p in e["loc"] if p not in _UNION_MEMBERS) or "(top level)"
        found = "" if e["type"] == "missing" else f" (found {e['input']!r:.40})"
        parts.append(f"{where}: {e['msg'].lower()}{found}")
    more = len(err.errors()) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def check_head(name: str, doc: dict) -> Head:
    """The manager's keys, typed; then the recorded config_hash against the recorded config."""

    try:
        head = Head.model_validate(doc)
    except ValidationError as err:
        raise SidecarProblem(f"{name} has malformed keys: {_problems(err)}", "bad_meta") from None
    if head.config_hash is not None and config_doc_hash(head.config) != head.config_hash:
        raise SidecarProblem(f"{name}: its config does not hash to its recorded config_hash (the file was "
                             "edited after it was saved)", "edited")
    return head


def check_trainer_state(name: str, meta: dict) -> None:
    """The trainer's keys a resume needs (data cursor, engine, RNG), typed and in range."""
    try:
        state = TrainerState.model_validate(meta)
    except ValidationError as err:
        raise SidecarProblem(f"{name} has no usable trainer state: {_problems(err)}", "bad_meta") from None
    if state.rng.torch_cpu is not None:
        import torch

        size, want = len(base64.b64decode(state.rng.torch_cpu)), torch.get_rng_state().numel()
        if size != want:
            raise SidecarProblem(f"{name} has no usable trainer state: rng.torch_cpu holds {size} bytes, "
                                 f"torch's generator {want}", "bad_meta")
