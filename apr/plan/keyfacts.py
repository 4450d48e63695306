"""One error finding at a config key, with the file, line and column the key was read from: the shape of
every feature's validate checks (apr/plan/mlmfacts.py, customfacts.py, moefacts.py, mlafacts.py,
timefacts.py). Torch-free."""

from __future__ import annotations

from apr.config import LoadedConfig
from apr.errors import Finding


def key_error(loaded: LoadedConfig, key: tuple, message: str, expected: str, got: str, *, code: str) -> Finding:
    """An error at ``key`` (a tuple of config path parts) with what was expected and what was found; a
    key the file does not state (a default) is placed at its nearest stated section."""
    file, line, column = loaded.source.where(key)
    for n in range(len(key) - 1, 0, -1):
        if line is None:
            file, line, column = loaded.source.where(key[:n])
    return Finding("error", code, message, path=".".join(key), file=file, line=line, column=column,
                   expected=expected, got=got)
