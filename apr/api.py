"""apr from Python: ``Trainer(config).fit()`` and ``load_model(run_dir)`` (docs/api.md).

A thin layer over the functions the CLI calls: ``Trainer.plan`` is ``apr train plan``'s
``build_plan``, ``Trainer.fit`` is ``apr train apply``'s ``run_apply`` (the plan, its contracts, then
the run), and ``load_model`` is ``apr generate``'s ``load_for_inference``. Errors are the same
``AprError`` values the CLI renders (message, findings, exit code); nothing here prints unless
``echo`` is given.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from apr.apply import run_apply
from apr.config.layers import parse_settings
from apr.errors import AprError, Finding
from apr.plan.build import build_plan
from apr.plan.examples import to_yaml


class Trainer:
    """One training run described by a config: a YAML path, or the same document as a dict.

    ``settings``: ``KEY=VALUE`` overrides as ``apr train apply`` takes them (a list of strings, or a
    dict ``{"optimizer.lr": 1e-3}``). ``echo``: called with each line the run logs (default: none).
    ``apr_home``: the experiment store's home (default: ``APR_HOME`` or ``~/.apr``)."""

    def __init__(self, config: str | Path | dict, *, settings: list[str] | dict | None = None,
                 echo: Callable[[str], None] | None = None, apr_home: str | Path | None = None):
        if not isinstance(config, (str, Path, dict)):
            raise AprError(f"Trainer takes a config path or a config dict, not {type(config).__name__}",
                           [Finding("error", "api.usage", "the config is neither a path nor a dict",
                                    expected="a path to a YAML config, or a dict", got=type(config).__name__)])
        self.config = config
        if isinstance(settings, dict):
            settings = [f"{key}={_setting_value(value)}" for key, value in settings.items()]
        self.settings = list(settings or [])
        self.echo = echo if echo is not None else (lambda line: None)
        self.apr_home = Path(apr_home) if apr_home is not None else None

    def plan(self):
        """The plan ``apr train plan`` shows (``apr.plan.build.Plan``: findings, facts, memory rows);
        its errors are in ``plan.errors``, nothing is raised for them."""
        with self._config_file() as path:
            return build_plan(path, overrides=parse_settings(self.settings) if self.settings else None)

    def fit(self, *, resume: str | None = None, max_steps: int | None = None, seed: int | None = None,
            device: str | None = None, force: bool = False):
        """Plan, refuse on error findings (``AprError``), then train: ``apr train apply`` with these
        options. Returns ``RunResult`` (status, run_dir, final_step, loss, val_loss,
        last_checkpoint...). ``resume``: ``"latest"`` or a checkpoint or run folder. Signals are
        handled as the CLI does (a checkpoint, then stop) when called from the main thread."""
        with self._config_file() as path:
            return run_apply(path, seed=seed, device=device, max_steps=max_steps, resume=resume, force=force,
                             apr_home=self.apr_home, echo=self.echo, settings=self.settings or None,
                             handle_signals=threading.current_thread() is threading.main_thread())

    def _config_file(self):
        return _ConfigFile(self.config)


class _ConfigFile:
    """The config as a file for the library: a path as it is; a dict written as YAML to a temporary
    folder for the call (the run folder keeps its own copy, ``config.yaml``, to resume from)."""

    def __init__(self, config: str | Path | dict):
        self.config = config
        self.folder: str | None = None

    def __enter__(self) -> Path:
        if not isinstance(self.config, dict):
            return Path(self.config)
        self.folder = tempfile.mkdtemp(prefix="apr-api-")
        path = Path(self.folder) / "config.yaml"
        path.write_text(to_yaml(self.config))
        return path

    def __exit__(self, *exc) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _setting_value(value: Any) -> str:
    """A Python value as a ``KEY=VALUE`` setting's YAML value (``True`` -> ``true``, ``None`` -> ``null``)."""
    if isinstance(value, str):
        return value
    return json.dumps(value)  # JSON is YAML: numbers, booleans, null, lists and mappings read back as given


def load_model(run_dir: str | Path, which: str = "last", *, device: str = "cpu", need_tokenizer: bool = False):
    """A run folder's model for inference (``apr.generate.load.Loaded``: ``.model``, a float32
    ``LlamaForCausalLM`` in eval mode, ``.tokenizer``, ``.step``, ``.config``). ``which``: ``"last"``
    (the newest complete, verified checkpoint) or ``"best"`` (``checkpoint-best``: the lowest
    validation loss). ``need_tokenizer``: fail unless the run's tokenizer is found."""
    from apr.generate.load import load_for_inference  # lazy: imports torch

    folder = Path(run_dir).expanduser()
    if which not in ("best", "last"):
        raise AprError(f"load_model: which must be 'best' or 'last', not {which!r}",
                       [Finding("error", "api.usage", "unknown checkpoint choice", expected="'best' or 'last'",
                                got=repr(which))])
    if not folder.is_dir():
        raise AprError(f"{folder}: not a run folder", [Finding("error", "api.run_dir", "no such folder",
                                                               file=str(folder), expected="a run folder",
                                                               got="nothing" if not folder.exists() else "a file")])
    source = folder / "checkpoint-best.json" if which == "best" else folder
    if which == "best" and not source.is_file():
        raise AprError(f"{folder} has no checkpoint-best.json: the run wrote no best checkpoint (it validates "
                       "with data.val and training.eval_interval > 0, and a best beats the initial weights)",
                       [Finding("error", "api.run_dir", "no best checkpoint", file=str(folder),
                                expected="checkpoint-best.json", got="none")])
    return load_for_inference(source, device=device, need_tokenizer=need_tokenizer)
