"""Where each effective config value came from: a schema default, a base file, the file itself or the
command line (`apr train plan --explain KEY` and the plan's "Config layers" section; the layers are
read by apr/config/layers.py)."""

from __future__ import annotations

import json
from typing import Any

from apr.config.layers import COMMAND_LINE
from apr.config.loader import LoadedConfig
from apr.errors import AprError, Finding


def _leaves(value: Any, loc: tuple) -> list[tuple[tuple, Any]]:
    if isinstance(value, dict) and value:
        out = []
        for key, sub in value.items():
            out += _leaves(sub, loc + (key,))
        return out
    return [(loc, value)]


def _show(value: Any) -> str:
    return json.dumps(value, default=str)


def origin(loaded: LoadedConfig, loc: tuple) -> str:
    """"default", "command line", or "FILE:LINE" of the file that set ``loc`` (or its section)."""
    layers, source = loaded.layers, loaded.source
    src = layers.origin_of(loc)
    if src is None or not _has(loaded.raw, loc):
        return "default"
    if src == COMMAND_LINE:
        return COMMAND_LINE
    line, _ = source.locate(loc)
    return f"{src}:{line}" if line else src


def changed_from_base(loaded: LoadedConfig) -> dict[str, dict]:
    """The values this file (or the command line) changes from what its bases (or the file) said."""
    out = {}
    for loc, before in loaded.layers.base_values.items():
        value = _lookup(loaded.raw, loc)
        out[".".join(map(str, loc))] = {"base": before, "value": value, "from": origin(loaded, loc)}
    return out


def _lookup(doc: Any, loc: tuple) -> Any:
    for part in loc:
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def layers_dict(loaded: LoadedConfig) -> dict:
    layers = loaded.layers
    return {"files": list(layers.files), "settings": dict(layers.settings),
            "changed_from_base": changed_from_base(loaded)}


def layer_lines(loaded: LoadedConfig) -> list[str]:
    """The plan's "Config layers" lines; empty when the config neither extends a base nor has settings."""
    layers = loaded.layers
    if len(layers.files) <= 1 and not layers.settings:
        return []
    out = []
    if len(layers.files) > 1:
        out.append("  files: " + " < ".join(layers.files) + (" < command line" if layers.settings else ""))
    for key, change in changed_from_base(loaded).items():
        out.append(f"  {key}: {_show(change['base'])} -> {_show(change['value'])}  ({change['from']})")
    for key, value in layers.settings.items():
        if key not in changed_from_base(loaded):
            out.append(f"  {key}: {_show(value)}  (command line)")
    return out


def explain_lines(loaded: LoadedConfig, key: str) -> str:
    """``KEY = VALUE  ORIGIN`` for the key, or for every value under it when it names a section."""
    doc = loaded.config.model_dump(mode="json")
    loc = tuple(p for p in key.split(".") if p)
    value = _lookup(doc, loc)
    if not loc or (value is None and not _has(doc, loc)):
        raise AprError(f"--explain: no config key {key!r}", [Finding(
            "error", "plan.explain", f"no key {key!r} in the effective config", path=key, file=str(loaded.path),
            expected="a dotted key or section such as training.max_steps or optimizer", got=repr(key))])
    rows = [(".".join(map(str, k)), _show(v), origin(loaded, k)) for k, v in _leaves(value, loc)]
    width = max(len(k) + len(v) for k, v, _ in rows) + 3
    lines = [f"{k} = {v}".ljust(width) + f"  {o}" for k, v, o in rows]
    return "\n".join(lines) + "\n"


def _has(doc: Any, loc: tuple) -> bool:
    for part in loc:
        if not isinstance(doc, dict) or part not in doc:
            return False
        doc = doc[part]
    return True
