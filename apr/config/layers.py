"""Config layers: ``extends: base.yaml`` and ``key.path=value`` settings from the command line.

Precedence, lowest first: the schema's defaults < each base file (a base may extend another) < the
file itself < the command line. Merge rule: mappings merge key by key, recursively; any other value
(a scalar, a list, null) replaces the base's value whole. ``extends`` is resolved relative to the
file that names it; a list extends several bases, later ones winning. Every key remembers the file
(and line) it came from, so a finding in a base file names that file, and ``apr train plan --explain
KEY`` can say where a value was set. docs/config.md ("Reusing configs") is the user's page.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.errors import ConfigError, Finding

COMMAND_LINE = "command line"
MAX_EXTENDS_DEPTH = 16
SETTING = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)=(?P<value>.*)$", re.S)


def is_setting(arg: str) -> bool:
    """A command-line ``key.path=value`` (a file name holding '=' after a path separator is not)."""
    return bool(SETTING.match(arg))


@dataclass
class Layers:
    """Where the effective config came from: the files in order of precedence (bases first) and the
    command-line settings, plus the origin of every key path."""

    files: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # "optimizer.lr" -> parsed value
    origin: dict[tuple, str] = field(default_factory=dict)  # key path -> file, or COMMAND_LINE
    base_values: dict[tuple, Any] = field(default_factory=dict)  # leaves the file or the command line replaced

    def origin_of(self, loc: tuple) -> str | None:
        loc = tuple(loc)
        while loc:
            if loc in self.origin:
                return self.origin[loc]
            loc = loc[:-1]
        return None

    def to_dict(self) -> dict:
        return {"files": list(self.files), "settings": dict(self.settings)}


def _merge(base: Any, top: Any, loc: tuple, top_file: str, origin: dict, replaced: dict) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for key, value in top.items():
            if key in base:
                out[key] = _merge(base[key], value, loc + (key,), top_file, origin, replaced)
            else:
                out[key] = value
                _claim(value, loc + (key,), top_file, origin)
        return out
    if base != top:
        replaced.setdefault(loc, base)
    _claim(top, loc, top_file, origin)
    return top


def _claim(value: Any, loc: tuple, file: str, origin: dict) -> None:
    origin[loc] = file
    for k in list(origin):
        if len(k) > len(loc) and k[:len(loc)] == loc:
            del origin[k]
    if isinstance(value, dict):
        for key, sub in value.items():
            _claim(sub, loc + (key,), file, origin)


def _extends_list(data: dict, file: str, positions: dict) -> list[str]:
    ext = data.get("extends")
    if ext is None:
        return []
    items = [ext] if isinstance(ext, str) else ext
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x.strip() for x in items):
        line, col = positions.get(("extends",), (None, None))
        raise ConfigError(f"{file}: extends must name a base config file", [Finding(
            "error", "config.extends", "extends must be a file name or a list of file names", path="extends",
            file=file, line=line, column=col, expected="a path such as base.yaml, relative to this file",
            got=repr(ext)[:60])])
    return items


def read_layered(path: Path) -> tuple[Any, dict, dict, str, Layers]:
    """Read ``path`` and the bases it extends. Returns (merged data, positions, files by key path,
    the top file's text, layers). Raises ConfigError on a missing or cyclic base."""
    from apr.config.loader import read_yaml

    layers = Layers()
    positions: dict = {}
    files: dict = {}

    def load(p: Path, chain: list[Path], named_at: tuple[str, int | None, int | None] | None) -> Any:
        try:
            resolved = p.resolve()
        except (OSError, RuntimeError):  # a symlink loop: read_yaml names it
            resolved = Path(os.path.abspath(p))
        if resolved in chain:
            cycle = " -> ".join(str(c) for c in [*chain[chain.index(resolved):], resolved])
            file, line, col = named_at
            raise ConfigError(f"{file}: extends makes a cycle", [Finding(
                "error", "config.extends_cycle", f"extends makes a cycle: {cycle}", path="extends", file=file,
                line=line, column=col, expected="a chain of bases that ends", got=cycle)])
        if len(chain) > MAX_EXTENDS_DEPTH:
            file, line, col = named_at
            raise ConfigError(f"{file}: extends chains more than {MAX_EXTENDS_DEPTH} files", [Finding(
                "error", "config.extends_depth", f"more than {MAX_EXTENDS_DEPTH} bases deep", path="extends",
                file=file, line=line, column=col, expected=f"at most {MAX_EXTENDS_DEPTH}", got="more")])
        if named_at is not None and not _exists(p):
            file, line, col = named_at
            what = "does not exist"
            raise ConfigError(f"{file}: the base config {p} {what}", [Finding(
                "error", "config.extends_missing", f"base config {p} {what}", path="extends", file=file,
                line=line, column=col, expected="a readable YAML config file", got=what)])
        data, source, text = read_yaml(p, what="config file" if named_at is None else "base config")
        if not isinstance(data, dict):
            return data, text
        my_pos = source.positions
        merged: Any = {}
        for name in _extends_list(data, source.file, my_pos):
            line, col = my_pos.get(("extends",), (None, None))
            base, _ = load(p.parent / name, [*chain, resolved], (source.file, line, col))
            if not isinstance(base, dict):
                raise ConfigError(f"{p.parent / name}: a base config must be a mapping", [Finding(
                    "error", "schema.type", "the top level must be a mapping of sections", file=str(p.parent / name),
                    line=1, column=1, expected="a mapping (model:, data:, ...)", got=type(base).__name__)])
            merged = _merge(merged, base, (), str(p.parent / name), {}, {})
        own = {k: v for k, v in data.items() if k != "extends"}
        for loc, pos in my_pos.items():
            if loc and loc[0] == "extends":
                continue
            positions[loc] = pos
            files[loc] = source.file
        layers.files.append(source.file)
        # every file claims its own keys (bases are loaded first, so later files win); only the top
        # file's replacements are "changed from the base"
        replaced = layers.base_values if named_at is None else {}
        return _merge(merged, own, (), source.file, layers.origin, replaced), text

    data, text = load(Path(path), [], None)
    return data, positions, files, text, layers


def _exists(p: Path) -> bool:
    """Something is there (read_yaml says what is wrong with a FIFO, a loop or a folder)."""
    try:
        return os.path.lexists(p)
    except OSError:
        return False


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=1e-3", "data.val=null"]`` -> ``{"optimizer.lr": 0.001, "data.val": None}``; values
    are read as YAML (numbers, booleans, null, flow lists and mappings), so they are typed as in a file."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    out: dict[str, Any] = {}
    for arg in settings:
        m = SETTING.match(arg)
        if not m:
            raise ConfigError(f"not a KEY=VALUE setting: {arg!r}", [Finding(
                "error", "config.setting", "a command-line setting is a dotted key, '=', and a value",
                file=COMMAND_LINE, expected="KEY.PATH=VALUE, e.g. training.max_steps=100", got=repr(arg)[:80])])
        text = m["value"]
        try:
            value = YAML(typ="safe", pure=True).load(text) if text.strip() else ""
        except YAMLError:
            value = text  # not YAML on its own: the plain string, as a file would hold it quoted
        if isinstance(value, str) and len(value) > 4096:
            raise ConfigError(f"setting {m['key']} is too long", [Finding(
                "error", "config.setting", "the value is longer than 4,096 characters", path=m["key"],
                file=COMMAND_LINE, expected="at most 4,096 characters", got=f"{len(value):,}")])
        out[m["key"]] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def apply_settings(data: Any, settings: dict[str, Any], layers: Layers) -> Any:
    """``data`` with each dotted setting written in (intermediate mappings created); a key whose parent
    holds a non-mapping value is refused. The schema then checks names and values like a file's."""
    if not settings:
        return data
    data = copy.deepcopy(data) if isinstance(data, dict) else {}
    for key, value in settings.items():
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(parts[:i + 1])
                raise ConfigError(f"cannot set {key}: {where} is not a mapping", [Finding(
                    "error", "config.setting", f"{where} holds {type(nxt).__name__}, not a section", path=key,
                    file=COMMAND_LINE, expected=f"a key inside a mapping at {where}", got=f"{key}={value!r}")])
            node = nxt
        loc = tuple(parts)
        if parts[-1] in node and node[parts[-1]] != value:
            layers.base_values.setdefault(loc, node[parts[-1]])
        node[parts[-1]] = value
        _claim(value, loc, COMMAND_LINE, layers.origin)
        layers.settings[key] = value
    return data
