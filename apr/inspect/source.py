"""The weights of a checkpoint, read a slice of rows at a time.

A source is an apr checkpoint (its JSON, its ``.safetensors`` or a sharded run's parts), a run
directory (its newest complete checkpoint), a Hugging Face folder (``model.safetensors`` or the
files its ``model.safetensors.index.json`` names) or any one ``.safetensors`` file. Tensors are
opened with safetensors' ``safe_open`` (memory-mapped) and read in row slices, so what is held at
once is one slice, whatever the checkpoint's size (docs/inspect.md, "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from apr.checkpoint.manager import CheckpointError, check_weights, read_info, scan
from apr.checkpoint.names import is_optimizer_state
from apr.checkpoint.parts import LazyTensors
from apr.errors import AprError, Finding
from apr.readers import load_json


class NotACheckpoint(AprError):
    """The path given to `apr inspect` holds no weights it can read."""


def _refuse(path: Path, why: str) -> NotACheckpoint:
    return NotACheckpoint(f"{path}: not a checkpoint ({why})", [Finding(
        "error", "inspect.not_a_checkpoint", why, file=str(path),
        expected="checkpoint-*.json / .safetensors, a run directory, a Hugging Face folder or a .safetensors file",
        got=why)])


@dataclass
class WeightSource:
    path: Path
    kind: str  # checkpoint | run | hf | safetensors
    step: int | None
    _lazies: dict  # tensor name -> LazyTensors that holds it

    @property
    def names(self) -> list[str]:
        return list(self._lazies)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._lazies[name].shapes[name])

    def dtype(self, name: str) -> str:
        return self._lazies[name].dtypes[name]

    def rows(self, name: str, start: int, stop: int):
        """Rows ``start:stop`` of tensor ``name`` (a 0-d or 1-d tensor is one row block)."""
        lazy = self._lazies[name]
        if len(self.shape(name)) == 0:
            return lazy[name].reshape(1)
        return lazy.rows(name, start, stop)


def _open(paths: list[Path], where: Path) -> LazyTensors:
    try:
        return LazyTensors(paths, keep=lambda n: not is_optimizer_state(n))
    except Exception as err:  # safetensors raises its own error types for a torn or foreign file
        raise _refuse(where, f"its weights cannot be read as safetensors: {str(err)[:200]}") from None


def _by_name(lazies: list[LazyTensors]) -> dict:
    return {name: lazy for lazy in lazies for name in lazy}


class Damaged(Exception):
    """The weights are not what their checkpoint's JSON recorded (``problem``: why)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def _apr(json_path: Path, kind: str, warn=None) -> WeightSource:
    """An apr checkpoint's weights. Weights that are not those its JSON recorded (another SHA-256 or
    size, another step's) raise ``Damaged`` without ``warn``; with it they are said and still shown
    (the user named this checkpoint: looking inside a damaged one is a reason to inspect)."""
    try:
        info = read_info(json_path)
    except CheckpointError as err:
        raise _refuse(json_path, err.message) from None
    try:
        check_weights(info)
    except CheckpointError as err:
        if warn is None:
            raise Damaged(err.message) from None
        warn(f"{err.message}: these are not the weights {json_path.name} recorded")
    return WeightSource(json_path, kind, info.step, _by_name([_open(info.weights_files, json_path)]))


def _run_dir(path: Path, warn=None) -> WeightSource:
    """The newest checkpoint of a run whose weights are those its JSON recorded; damaged ones are
    passed over (and said through ``warn``), as a resume does."""
    errors = []
    for entry in scan(path):
        if entry.complete:
            try:
                return _apr(entry.json_path, "run")
            except NotACheckpoint as err:
                errors.append(err.message)  # a torn newest checkpoint: fall back to the one before
            except Damaged as err:
                errors.append(err.problem)
                if warn is not None:
                    warn(f"{err.problem}; passed over")
    raise _refuse(path, errors[0] if errors else "a folder with no checkpoint-step-*.json and no model.safetensors")


def _hf_dir(path: Path) -> WeightSource:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        doc = load_json(index, "checkpoint", "safetensors index", error=NotACheckpoint)
        files = sorted(set((doc.get("weight_map") or {}).values())) if isinstance(doc, dict) else []
        if not files:
            raise _refuse(index, "the index names no weight files (weight_map)")
        return WeightSource(path, "hf", None, _by_name([_open([path / f], path / f) for f in files]))
    return WeightSource(path, "hf", None, _by_name([_open([path / "model.safetensors"], path)]))


def open_weights(source: str | Path, warn=None) -> WeightSource:
    """``warn``: told of damaged or edited checkpoints (a run folder's are passed over, a named
    checkpoint's are still shown); without it such a checkpoint is refused."""
    path = Path(source).expanduser()
    if not path.exists():
        raise _refuse(path, "no such file or folder")
    if path.is_dir():
        if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
            return _hf_dir(path)
        return _run_dir(path, warn)
    if path.suffix == ".json" or (path.suffix == ".safetensors" and path.with_suffix(".json").is_file()):
        try:
            return _apr(path.with_suffix(".json"), "checkpoint", warn)
        except Damaged as err:
            raise _refuse(path, err.problem) from None
    if path.suffix == ".safetensors":
        return WeightSource(path, "safetensors", None, _by_name([_open([path], path)]))
    raise _refuse(path, f"a {path.suffix or 'suffix-less'} file")
