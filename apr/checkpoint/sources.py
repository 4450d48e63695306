"""Weight sources: the one reader of every path apr takes weights from (``model.init_from``, a
distillation teacher, ``apr generate``, ``eval``, ``verify``, ``inspect``, ``profile``;
docs/checkpoints.md, "Weight sources").

``open_source(path)`` recognises

* ``checkpoint``: an apr checkpoint, named by its JSON, its ``.safetensors`` or one of a sharded
  run's part files (``checkpoint-step-N.part-R-of-K.safetensors``: the parts are read as one);
* ``run``: a run directory, its newest usable checkpoint (damaged ones passed over, as a resume does);
* ``hf``: a Hugging Face folder, ``model.safetensors`` or the shards its
  ``model.safetensors.index.json`` names (the index checked against the shards' headers);
* ``safetensors``: any other one ``.safetensors`` file (tensors only: no config to build a model);

and returns a ``WeightSource``: the architecture (and for an apr checkpoint the config) the source
implies, and its tensors by apr name, read when asked (whole, or a slice of rows). Opening reads
JSON and safetensors headers only (no torch); the files are mapped on the first read. Anything else
is refused with a ``SourceError`` naming the path, what was expected and what was found. Nothing is
unpickled: ``.bin`` / ``.pt`` weights are refused by name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.checkpoint import manager
from apr.checkpoint.files import ST_ITEM_BYTES
from apr.checkpoint.manager import CheckpointError, CheckpointInfo
from apr.checkpoint.names import is_optimizer_state
from apr.checkpoint.parts import LazyTensors
from apr.config.hf_folder import family_problem, filled_fields, unsupported_math, unsupported_message
from apr.config.schema import AprConfig, Architecture
from apr.errors import AprError, Finding
from apr.readers import InputError, load_json
from apr.steps import stacking

EXPECTED = ("an apr checkpoint (checkpoint-*.json, its .safetensors or a part file), a run directory, a Hugging "
            "Face folder (config.json with model.safetensors or model.safetensors.index.json) or a .safetensors file")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
_RECOMPUTED = (".rotary_emb.inv_freq",)  # buffers older transformers saved; apr recomputes them


class SourceError(AprError):
    """A path that holds no weights apr can read."""


def _refuse(path: Path, reason: str, message: str, got: str | None = None, expected: str = EXPECTED) -> SourceError:
    return SourceError(message, [Finding("error", f"source.{reason}", message, file=str(path), expected=expected,
                                         got=got)])


def pickle_refusal(file: Path) -> SourceError:
    return _refuse(file, "pickle", f"{file} is a PyTorch pickle file; apr never unpickles weights (loading a pickle "
                   "can run code). Save the model as safetensors (transformers: save_pretrained(folder, "
                   "safe_serialization=True)) and name that folder", got=file.name,
                   expected=f"{HF_SINGLE} or {HF_INDEX}")


@dataclass
class WeightSource:
    """What ``open_source`` found: where, which kind, and the tensors by name (read when asked)."""

    path: Path  # the path as named (``~`` expanded)
    kind: str  # checkpoint | run | hf | safetensors
    step: int | None = None  # an apr checkpoint's step
    sharded: bool = False  # a sharded run's parts, or a Hugging Face index and its shards
    info: CheckpointInfo | None = None  # an apr checkpoint's JSON
    _lazies: dict[str, LazyTensors] = field(default_factory=dict, repr=False)  # tensor name -> the file(s) holding it
    _hf_config: dict | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ tensors
    @property
    def names(self) -> list[str]:
        return list(self._lazies)

    def __contains__(self, name: str) -> bool:
        return name in self._lazies

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._lazies[name].shapes[name])

    def dtype(self, name: str) -> str:
        """The safetensors dtype code (F32, BF16, ...)."""
        return self._lazies[name].dtypes[name]

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * ST_ITEM_BYTES.get(self.dtype(name), 4)

    def file_of(self, name: str) -> Path:
        """The file holding ``name`` (a sharded apr checkpoint's first part)."""
        return self._lazies[name].paths[0]

    @property
    def files(self) -> list[Path]:
        return sorted({p for lazy in self._lazies.values() for p in lazy.paths})

    def tensor(self, name: str):
        """The whole tensor ``name`` (CPU, its stored dtype)."""
        return self._lazies[name][name]

    def rows(self, name: str, start: int, stop: int):
        """Rows ``start:stop`` of tensor ``name`` (a 0-d tensor is one row block)."""
        if len(self.shape(name)) == 0:
            return self.tensor(name).reshape(1)
        return self._lazies[name].rows(name, start, stop)

    def read(self, names=None, dtype=None) -> dict:
        """Tensors by name (all, or ``names``), optionally cast (``torch.float32``). A file that
        cannot be mapped raises SourceError naming it."""
        out = {}
        for name in self.names if names is None else names:
            try:
                t = self.tensor(name)
            except Exception as err:  # safetensors raises its own SafetensorError
                raise _refuse(self.file_of(name), "bad_weights", f"{self.file_of(name)} cannot be read: "
                              f"{str(err)[:200]}", got=str(err)[:200]) from None
            out[name] = t if dtype is None else t.to(dtype)
        return out

    # ------------------------------------------------------------------ what it implies
    @property
    def config_path(self) -> Path | None:
        """A Hugging Face folder's config.json (None for other kinds, or when it has none)."""
        if self.kind != "hf":
            return None
        path = self.path / "config.json"
        return path if path.is_file() else None

    def hf_config(self) -> dict:
        """A Hugging Face folder's config.json, parsed (SourceError when absent or not an object)."""
        if self._hf_config is None:
            cfg = self.path / "config.json"
            if self.config_path is None:
                raise _refuse(cfg, "no_config", f"{self.path} has weights but no config.json: nothing says which "
                              "model they are", got="no config.json", expected="config.json beside the weights")
            try:
                doc = load_json(cfg, "checkpoint", "Hugging Face config.json")
            except InputError as err:
                raise SourceError(err.message, err.findings) from None
            if not isinstance(doc, dict):
                raise _refuse(cfg, "bad_config", f"{cfg} is not a JSON object", got=type(doc).__name__,
                              expected="a JSON object")
            self._hf_config = doc
        return self._hf_config

    def apr_config(self) -> AprConfig | None:
        """An apr checkpoint's stored config at its step (the depth progressive stacking had then);
        None for the other kinds. SourceError when the stored config does not validate."""
        if self.info is None:
            return None
        try:
            config = AprConfig.model_validate(self.info.config)
        except Exception as err:  # pydantic ValidationError: a stored config from another apr version
            raise _refuse(self.info.json_path, "bad_config", f"{self.info.json_path}: its stored config does not "
                          f"validate: {err}", expected="a config this apr version reads") from None
        return stacking.config_at(config, self.info.step)

    def architecture(self) -> Architecture:
        """The model the weights are: a Hugging Face folder's config.json (of a family apr runs, with
        no math apr does not implement), or an apr checkpoint's stored architecture at its step."""
        if self.info is not None:
            try:
                return manager._architecture(self.info.config, self.info.step)
            except Exception as err:  # pydantic ValidationError, KeyError: a JSON apr did not write
                raise _refuse(self.info.json_path, "bad_config", f"{self.info.json_path.name}: its config has no "
                              f"valid model.architecture ({err})", expected="a stored model.architecture") from None
        if self.kind != "hf":
            raise _refuse(self.path, "no_config", f"{self.path} is a bare .safetensors file: nothing says which model "
                          "its tensors are", got="no config", expected="an apr checkpoint or a Hugging Face folder")
        return hf_architecture(self.hf_config(), self.path / "config.json")


def hf_architecture(doc: dict, where: Path) -> Architecture:
    """The Architecture a Hugging Face config.json of a family apr runs describes. SourceError
    naming the key when the family or a key's math is not one apr implements."""
    problem = family_problem(doc)
    if problem is not None:
        raise SourceError(f"{where}: {problem[0]} is not a family apr runs", [Finding(
            "error", "source.architecture", f"{problem[0]} is not a family apr runs", path="model_type",
            file=str(where), expected=problem[1], got=repr(doc.get("model_type")))])
    for key, value, want in unsupported_math(doc)[:1]:
        raise SourceError(unsupported_message(where, key, value, want), [Finding(
            "error", "source.architecture", f"{key} is not implemented by apr", path=key, file=str(where),
            expected=want, got=f"{key}: {value!r}")])
    try:
        return Architecture.model_validate(filled_fields(doc))
    except Exception as err:  # pydantic ValidationError
        first = str(err).splitlines()[0]
        raise SourceError(f"{where}: not a model config apr can run: {err}", [Finding(
            "error", "source.architecture", first, file=str(where))]) from None


# ---------------------------------------------------------------------------------- opening


def open_source(source: str | os.PathLike, *, verify: bool = True, warn: Callable[[str], None] | None = None,
                show_damaged: bool = False) -> WeightSource:
    """Recognise and open ``source`` (see the module's docstring).

    ``verify``: an apr checkpoint's files have the size and SHA-256 its JSON recorded and hold the
    model it describes (a run directory passes over those that do not, saying so through ``warn``);
    without it only headers are read (what a plan does). ``show_damaged``: a checkpoint named
    directly whose weights are not what its JSON recorded is still opened, said through ``warn``
    (looking inside a damaged checkpoint is a reason to inspect); otherwise it is refused."""
    path = Path(source).expanduser()
    if path.suffix in PICKLE_SUFFIXES and path.is_file():
        raise pickle_refusal(path)
    if not path.exists():
        raise _refuse(path, "missing", f"{path} does not exist: no such file or folder", got="nothing")
    if path.is_dir():
        if (path / HF_SINGLE).is_file() or (path / HF_INDEX).is_file():
            return _hf_folder(path)
        if (path / "config.json").is_file():
            pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise pickle_refusal(pickles[0])
            raise _refuse(path, "no_weights", f"{path} has config.json but no {HF_SINGLE} or {HF_INDEX}",
                          got=_listing(path), expected=f"{HF_SINGLE} or {HF_INDEX}")
        return _run_dir(path, verify, warn)
    if path.suffix == ".json" or (path.suffix == ".safetensors" and manager._json_for(path).is_file()):
        return _checkpoint(manager._json_for(path), path, verify, warn, show_damaged)
    if path.suffix == ".safetensors":
        return WeightSource(path, "safetensors", _lazies=_by_name([_lazy([path], path)]))
    raise _refuse(path, "unknown", f"{path}: not a weight source (a {path.suffix or 'suffix-less'} file)",
                  got=f"a {path.suffix or 'suffix-less'} file")


def _listing(folder: Path) -> str:
    return ", ".join(sorted(p.name for p in folder.iterdir())[:6]) or "an empty folder"


def _lazy(paths: list[Path], where: Path, keep=lambda name: True) -> LazyTensors:
    try:
        return LazyTensors(paths, keep)
    except (OSError, ValueError) as err:  # the header check's ValueError, or the parts' disagreement
        raise _refuse(where, "bad_weights", f"{where}: its weights cannot be read as safetensors: {str(err)[:200]}",
                      got=str(err)[:200], expected="safetensors weights") from None


def _by_name(lazies: list[LazyTensors]) -> dict[str, LazyTensors]:
    return {name: lazy for lazy in lazies for name in lazy}


def _weights(name: str) -> bool:
    return not is_optimizer_state(name)  # AdamW moments and a loss part's tensors are not the model's


def _from_checkpoint(info: CheckpointInfo, path: Path, kind: str, tensors: Any = None) -> WeightSource:
    lazy = tensors if isinstance(tensors, LazyTensors) else _lazy(info.weights_files, info.json_path, _weights)
    return WeightSource(path, kind, info.step, sharded=bool(info.parts), info=info, _lazies=_by_name([lazy]))


def _refused_checkpoint(err: CheckpointError, where: Path) -> SourceError:
    return SourceError(f"{where}: {err.message}" if str(where) not in err.message else err.message, err.findings)


def _checkpoint(json_path: Path, named: Path, verify: bool, warn, show_damaged: bool) -> WeightSource:
    if verify:
        try:
            state = manager.read_checkpoint(json_path, weights_only=True, lazy=True)
            return _from_checkpoint(state.info, named, "checkpoint", state.tensors)
        except CheckpointError as err:
            if not (show_damaged and warn is not None and err.reason in manager.FALLBACK_REASONS
                    and err.reason not in ("unreadable", "not_apr", "unsupported_version")):
                raise _refused_checkpoint(err, named) from None
            warn(f"{err.message}: these are not the weights {json_path.name} recorded")
    try:
        info = manager.read_info(json_path)
        for file in info.weights_files:
            if not file.is_file():
                raise CheckpointError(f"{file.name} (named by {json_path.name}) does not exist", file,
                                      "missing_weights")
    except CheckpointError as err:
        raise _refused_checkpoint(err, named) from None
    return _from_checkpoint(info, named, "checkpoint")


def _run_dir(path: Path, verify: bool, warn) -> WeightSource:
    entries = manager.scan(path)
    if not any(e.complete for e in entries) and not (path / "checkpoint-best.json").is_file():
        raise _refuse(path, "no_checkpoint", f"{path}: a folder with no checkpoint-step-*.json, no {HF_SINGLE} "
                      f"and no {HF_INDEX}", got=_listing(path))
    if not verify:  # headers only: the newest complete checkpoint, as a plan reads it
        newest = next((e for e in entries if e.complete), None)
        json_path = newest.json_path if newest else path / "checkpoint-best.json"
        try:
            return _from_checkpoint(manager.read_info(json_path), path, "run")
        except CheckpointError as err:
            raise _refused_checkpoint(err, path) from None
    try:
        state = manager.load_latest(path, warn=warn or (lambda message: None), weights_only=True, lazy=True)
    except CheckpointError as err:
        raise _refused_checkpoint(err, path) from None
    return _from_checkpoint(state.info, path, "run", state.tensors)


def _hf_folder(folder: Path) -> WeightSource:
    single, index = folder / HF_SINGLE, folder / HF_INDEX
    keep = lambda name: not name.endswith(_RECOMPUTED)  # noqa: E731
    if single.is_file():
        return WeightSource(folder, "hf", _lazies=_by_name([_lazy([single], single, keep)]))
    weight_map = _weight_map(index)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise _refuse(index, "missing_shard", f"{index} names {len(missing)} shard(s) not in {folder}: "
                      + ", ".join(missing[:4]), got=f"{missing[0]} missing",
                      expected="every file the index's weight_map names, beside it")
    lazies = [_lazy([folder / s], folder / s, keep) for s in shards]
    by_name: dict[str, LazyTensors] = {}
    for lazy in lazies:
        for name in lazy:
            if name in by_name:
                raise _refuse(lazy.paths[0], "bad_index", f"tensor {name} is in both {by_name[name].paths[0].name} "
                              f"and {lazy.paths[0].name}", got=lazy.paths[0].name, expected="each tensor in one shard")
            by_name[name] = lazy
    for name, shard in weight_map.items():
        found = by_name.get(name)
        if found is None and not name.endswith(_RECOMPUTED):
            raise _refuse(index, "bad_index", f"{index} puts {name} in {shard}, but no shard holds it",
                          got="absent", expected=f"{name} in {shard}")
        if found is not None and found.paths[0].name != shard:
            raise _refuse(index, "bad_index", f"{index} puts {name} in {shard}, but it is in {found.paths[0].name}",
                          got=found.paths[0].name, expected=shard)
    return WeightSource(folder, "hf", sharded=True, _lazies=by_name)


def _weight_map(index: Path) -> dict[str, str]:
    try:
        doc = load_json(index, "checkpoint", "safetensors index")
    except InputError as err:
        raise SourceError(err.message, err.findings) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise _refuse(index, "bad_index", f"{index} has no weight_map of tensor name -> shard file",
                      got=repr(weight_map)[:80], expected='{"weight_map": {"name": "file.safetensors"}}')
    for shard in set(weight_map.values()):
        if Path(shard).name != shard or shard.startswith("."):
            raise _refuse(index, "bad_index", f"{index} names a shard outside its folder: {shard!r}", got=shard,
                          expected="a file name in the same folder")
        if Path(shard).suffix in PICKLE_SUFFIXES:
            raise pickle_refusal(index.parent / shard)
    return weight_map
