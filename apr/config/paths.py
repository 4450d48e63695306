"""Where a run may write: checks on ``training.output_dir`` against the machine and the run's inputs.

A run writes checkpoints, records and a resolved config into its output folder and, on a fresh
run, treats what is there as its own. A filesystem root, the home folder itself, or a folder that
is, holds or lies inside the data or the tokenizer would mix the run's files with the user's.
"""

from __future__ import annotations

import os
from pathlib import Path

from apr.config.schema import AprConfig


def _resolve(path: str) -> Path:
    """As the trainer opens it: ``~`` expanded, relative to the current directory, symlinks followed."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def output_dir_problems(config: AprConfig) -> list[tuple[str, str]]:
    """(message, what was found) for every reason ``training.output_dir`` must not be written to."""
    text = config.training.output_dir
    out = _resolve(text)
    problems: list[tuple[str, str]] = []
    if out == Path(out.anchor) or os.path.ismount(out):
        problems.append((f"output_dir {text!r} is a filesystem root ({out}): a run's checkpoints and records need a "
                         "folder of their own", f"{out} (a filesystem root)"))
    home = _resolve("~")
    if out == home:
        problems.append((f"output_dir {text!r} is your home folder itself: a run's checkpoints and records need a "
                         "folder of their own", f"{out} (the home folder)"))
    data = config.data
    inputs = [*data.train_paths(), *data.val_paths(), ("data.tokenizer", data.tokenizer)]
    for key, value in inputs:
        if not value:
            continue
        target = _resolve(value)
        if _within(target, out):
            how = "is" if target == out else "holds"
            problems.append((f"output_dir {text!r} {how} {key} ({value}): the run would write among its own inputs",
                             f"{out}, which {how} {target}"))
        elif _within(out, target) and key != "data.tokenizer":
            problems.append((f"output_dir {text!r} is inside {key} ({value}): the run's files would become data",
                             f"{out}, inside {target}"))
    return problems


def data_path_problems(config: AprConfig) -> list[tuple[str, str, str]]:
    """(key, message, what was found) for ``data.train`` / ``data.val`` that is a filesystem root or
    the home folder itself: planning walks every file under a data folder (shards, fingerprint), so
    such a path costs minutes before it could say that it holds no shards."""
    problems = []
    home = _resolve("~")
    for key, value in (*config.data.train_paths(), *config.data.val_paths()):
        if not value:
            continue
        target = _resolve(value)
        if target == Path(target.anchor):
            problems.append((key, f"{key} {value!r} is a filesystem root ({target}): point it at a folder of "
                                  "pretokenized shards (apr data pretokenize --out DIR)",
                             f"{target} (a filesystem root)"))
        elif target == home:
            problems.append((key, f"{key} {value!r} is your home folder itself: point it at a folder of pretokenized "
                                  "shards (apr data pretokenize --out DIR)", f"{target} (the home folder)"))
    return problems


def train_val_problems(config: AprConfig) -> list[tuple[str, str, str, str]]:
    """(val key, train key, message, what was found) for every validation input that is, holds or
    lies inside a training input once paths are resolved (``data.val: ./data/train/`` against
    ``data.train: data/train``, or a mixture source's path): the loader reads a folder's shards
    recursively, so the validation loss would be measured on training data."""
    data = config.data
    trains = [(key, value, _resolve(value)) for key, value in data.train_paths() if value]
    problems = []
    for val_key, val_text in data.val_paths():
        val = _resolve(val_text)
        for train_key, train_text, train in trains:
            if val == train:
                how = "is"
            elif _within(val, train):
                how = "lies inside"
            elif _within(train, val):
                how = "holds"
            else:
                continue
            problems.append((val_key, train_key, f"{val_key} ({val_text}) {how} {train_key} ({train_text}): the "
                             "validation loss would be measured on training data", f"{val}, which {how} {train}"))
    return problems
