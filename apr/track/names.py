"""Run ids and experiment names: generated, validated (no path traversal, no shell surprises)."""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from apr.config.schema import SAFE_NAME_RULE, is_safe_name
from apr.errors import AprError, Finding


def _check(value: str, what: str, code: str) -> str:
    if not is_safe_name(value):
        raise AprError(
            f"invalid {what} {value!r}",
            [
                Finding(
                    "error",
                    code,
                    f"invalid {what} {value!r}",
                    expected=SAFE_NAME_RULE,
                    got=repr(value),
                )
            ],
        )
    return value


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` unchanged if it is a safe run id, else raise AprError."""
    return _check(run_id, "run id", "track.invalid_run_id")


def validate_experiment(name: str) -> str:
    """Return ``name`` unchanged if it is a safe experiment name, else raise AprError."""
    return _check(name, "experiment name", "track.invalid_experiment")


def new_run_id(now: float | None = None) -> str:
    """A fresh run id: UTC time to the second plus 6 random hex digits, e.g. ``20261122-153012-a1b2c3``.

    Sorting ids sorts runs by start time; the random suffix keeps parallel starts apart.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


def experiment_from_dir(output_dir: Path) -> str:
    """A safe experiment name derived from a run directory's name (the default experiment)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(os.path.abspath(output_dir)).name).strip("-._")
    name = re.sub(r"\.{2,}", ".", name)[:128]
    return name or "default"


def apr_home() -> Path:
    """``$APR_HOME`` if set, else ``~/.apr``: where the global registry lives."""
    env = os.environ.get("APR_HOME")
    return Path(env).expanduser() if env else Path.home() / ".apr"


def compile_cache_dir() -> Path:
    """Where torch.compile's inductor keeps compiled graphs for apr's runs: ``$TORCHINDUCTOR_CACHE_DIR``
    when the user set it, else ``<APR_HOME>/cache/inductor``, so a second run or a resume on this
    machine reuses them (docs/design.md, "Compile when it pays")."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(env).expanduser() if env else apr_home() / "cache" / "inductor"


def compile_cache_warm(folder: Path | None = None) -> bool:
    """Whether the compile cache holds compiled graphs (a file in inductor's ``fxgraph`` or
    ``aotautograd`` cache); an empty folder, or one of only locks and empty folders, is cold (a
    first run on this machine pays the cold cost)."""
    folder = folder if folder is not None else compile_cache_dir()
    for sub in ("fxgraph", "aotautograd"):
        for _dirpath, _dirnames, filenames in os.walk(folder / sub):
            if filenames:
                return True
    return False


def global_db_path(home: Path | None = None) -> Path:
    return (home if home is not None else apr_home()) / "experiments.db"


def local_db_path(output_dir: Path) -> Path:
    return Path(output_dir) / ".apr" / "experiments.db"

# The "format" of a plan file (apr train plan -out) and of a run's plan.json.
PLAN_FORMAT = "apr-plan"
