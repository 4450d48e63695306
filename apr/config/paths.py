"""Where a run may write: checks on ``training.output_dir`` against the machine and the run's inputs.

A run writes checkpoints, records and a resolved config into its output folder and, on a fresh
run, treats what is there as its own. A filesystem root, the home folder itself, or a folder that
is, holds or lies inside the data or the tokenizer would mix the run's files with the user's.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from apr.config.schema import AprConfig


def _resolve(path: str) -> Path:
    """As the trainer opens it: ``~`` expanded, relative to the current directory, symlinks followed."""
    return Path(os.path.realpath(os.path.expanduser(path)))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _kind(mode: int) -> str:
    return ("a regular file" if stat.S_ISREG(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a folder")


def _not_a_folder(text: str, out: Path) -> tuple[str, str] | None:
    """The output folder itself, or the nearest existing folder above it, is something else (a file,
    a FIFO, a device): apply could neither make the folder nor lock it."""
    for path in (out, *out.parents):
        try:
            mode = path.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):  # not there yet, or under a file (found next)
            continue
        except OSError as err:
            return (f"output_dir {text!r} cannot be used: {path}: {err.strerror or err}", f"{path}: {err.strerror}")
        if stat.S_ISDIR(mode):
            return None
        if path == out:
            return (f"output_dir {text!r} is {_kind(mode)} ({out}), not a folder: a run's checkpoints and records "
                    "need a folder of their own", f"{out} ({_kind(mode)})")
        return (f"output_dir {text!r} lies under {path}, which is {_kind(mode)}, not a folder",
                f"{out}, under {_kind(mode)}")
    return None


def output_dir_problems(config: AprConfig) -> list[tuple[str, str]]:
    """(message, what was found) for every reason ``training.output_dir`` must not be written to."""
    text = config.training.output_dir
    out = _resolve(text)
    problems: list[tuple[str, str]] = []
    shape = _not_a_folder(text, out)
    if shape is not None:
        problems.append(shape)
    home_of_apr = _resolve(os.environ.get("APR_HOME") or "~/.apr")  # apr.track.names.apr_home, import-free
    if _within(out, home_of_apr):
        problems.append((f"output_dir {text!r} is {'' if out == home_of_apr else 'inside '}apr's own home "
                         f"({home_of_apr}, $APR_HOME): it holds apr's registry and caches, not runs",
                         f"{out} (apr's home)"))
    elif ".apr" in out.parts:
        problems.append((f"output_dir {text!r} is inside a run's .apr/ records folder: a run's checkpoints "
                         "need a folder of their own", f"{out} (inside .apr/)"))
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
