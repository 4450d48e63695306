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
from apr.quoting import describe, of_kind, what_it_holds

COMMAND_LINE = "command line"
MAX_EXTENDS_DEPTH = 16
# Bounds on all the layers together (docs/config.md, "Where extends may point"): each file is
# bounded on its own by read_yaml; a fan-out of bases (a diamond or a tree) re-reads and re-merges
# them, so the files read (repeats counted), their bytes and their values are bounded in total.
MAX_EXTENDS_FILES = 32
MAX_LAYERED_BYTES = 128 * 1024
MAX_LAYERED_VALUES = 4_000
BASE_SUFFIXES = (".yaml", ".yml")
# Set to 1 to let `extends` name a file anywhere (an absolute path, or outside the repository).
EXTENDS_ANYWHERE_ENV = "APR_EXTENDS_ANYWHERE"
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


def _extends_list(data: dict, file: str, positions: dict, is_base: bool = False) -> list[str]:
    ext = data.get("extends")
    if ext is None:
        return []
    items = [ext] if isinstance(ext, str) else ext
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x.strip() for x in items):
        line, col = positions.get(("extends",), (None, None))
        raise ConfigError(f"{file}: extends must name a base config file", [Finding(
            "error", "config.extends", "extends must be a file name or a list of file names", path="extends",
            file=file, line=line, column=col, expected="a path such as base.yaml, relative to this file",
            got=describe(ext, show=not is_base))])  # a base's values are never echoed
    return items


def tree_root(config: Path) -> Path:
    """Where a config's bases may live: the repository holding it (the nearest folder above it with a
    ``.git``), else the current folder when the config lies inside it, else the config's own folder."""
    here = Path(os.path.realpath(config)).parent
    for folder in (here, *here.parents):
        if os.path.lexists(folder / ".git"):
            return folder
    cwd = Path(os.path.realpath(os.getcwd()))
    return cwd if _within(here, cwd) else here


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _count_values(node: Any) -> int:
    if isinstance(node, dict):
        return 1 + sum(_count_values(v) for v in node.values())
    if isinstance(node, list):
        return 1 + sum(_count_values(v) for v in node)
    return 1


def _base_problem(name: str, base: Path, root: Path) -> tuple[str, str, str] | None:
    """(code, message, expected) when ``extends`` may not name ``name`` (resolved to ``base``)."""
    anywhere = os.environ.get(EXTENDS_ANYWHERE_ENV) == "1"
    if Path(name).suffix.lower() not in BASE_SUFFIXES:
        return ("config.extends_kind", f"base config {name} is not a YAML file (.yaml or .yml)",
                "a .yaml or .yml apr config")
    if anywhere:
        return None
    if Path(name).is_absolute() or name.startswith("~"):
        return ("config.extends_outside", f"extends names an absolute path ({name}): bases are named relative to "
                f"the config, inside {root} (set {EXTENDS_ANYWHERE_ENV}=1 to allow any path)",
                f"a path relative to the config, inside {root}")
    if not _within(Path(os.path.realpath(base)), root):
        return ("config.extends_outside", f"base config {name} lies outside {root} (the repository, or the "
                f"current folder, holding the config; set {EXTENDS_ANYWHERE_ENV}=1 to allow any path)",
                f"a file inside {root}")
    return None


def read_layered(path: Path) -> tuple[Any, dict, dict, str, Layers]:
    """Read ``path`` and the bases it extends. Returns (merged data, positions, files by key path,
    the top file's text, layers). Raises ConfigError on a missing, cyclic, misplaced or oversized
    base (docs/config.md, "Where extends may point")."""
    from apr.config.yamlfile import read_yaml

    layers = Layers()
    positions: dict = {}
    files: dict = {}
    root = tree_root(Path(path))
    parsed: dict[Path, tuple] = {}  # a base reached twice (a diamond) is read once
    spent = {"files": 0, "bytes": 0, "values": 0}

    def refuse(named_at, code: str, message: str, expected: str, got: str | None = None):
        file, line, col = named_at
        raise ConfigError(f"{file}: {message}", [Finding("error", code, message, path="extends", file=file,
                                                         line=line, column=col, expected=expected, got=got)])

    def spend(p: Path, named_at) -> None:
        try:
            size = os.stat(p).st_size
        except OSError:
            size = 0  # read_yaml names what is wrong with it
        spent["files"] += 1
        spent["bytes"] += size
        if named_at is None:
            return
        if spent["files"] > MAX_EXTENDS_FILES:
            refuse(named_at, "config.extends_too_many", f"extends reads more than {MAX_EXTENDS_FILES} files in all "
                   "(a base named twice counts twice)", f"at most {MAX_EXTENDS_FILES} files", "more")
        if spent["bytes"] > MAX_LAYERED_BYTES:
            refuse(named_at, "config.extends_too_large", f"the config and its bases hold more than "
                   f"{MAX_LAYERED_BYTES // 1024} KiB in all (a base named twice counts twice)",
                   f"at most {MAX_LAYERED_BYTES // 1024} KiB", f"{spent['bytes'] // 1024} KiB or more")

    def load(p: Path, chain: list[Path], named_at: tuple[str, int | None, int | None] | None) -> Any:
        try:
            resolved = p.resolve()
        except (OSError, RuntimeError):  # a symlink loop: read_yaml names it
            resolved = Path(os.path.abspath(p))
        if resolved in chain:
            cycle = " -> ".join(str(c) for c in [*chain[chain.index(resolved):], resolved])
            refuse(named_at, "config.extends_cycle", f"extends makes a cycle: {cycle}", "a chain of bases that ends",
                   cycle)
        if len(chain) > MAX_EXTENDS_DEPTH:
            refuse(named_at, "config.extends_depth", f"more than {MAX_EXTENDS_DEPTH} bases deep",
                   f"at most {MAX_EXTENDS_DEPTH}", "more")
        if named_at is not None and not _exists(p):
            refuse(named_at, "config.extends_missing", f"base config {p} does not exist",
                   "a readable YAML config file", "does not exist")
        spend(p, named_at)
        if resolved not in parsed:
            parsed[resolved] = read_yaml(p, what="config file" if named_at is None else "base config")
        data, source, text = parsed[resolved]
        spent["values"] += _count_values(data)
        if spent["values"] > MAX_LAYERED_VALUES and named_at is not None:
            refuse(named_at, "config.extends_too_large", f"the config and its bases hold more than "
                   f"{MAX_LAYERED_VALUES:,} values in all (a base named twice counts twice)",
                   f"at most {MAX_LAYERED_VALUES:,} values", f"{spent['values']:,} or more")
        if data is not None and not of_kind(data, config_sections()):
            # a file that is no apr config at all (`--config /etc/passwd`, `extends: ../.env`):
            # refused whole, saying what it holds in words, never its keys or lines (apr/quoting.py)
            file = str(p)
            raise ConfigError(f"{file} is not an apr config", [Finding(
                "error", "config.not_a_config", "the file is not an apr config: its top level "
                + ("is not a mapping" if not isinstance(data, dict) else "names no section of one"),
                file=file, line=1, column=1,
                expected="a mapping of sections: " + ", ".join(config_sections()),
                got=what_it_holds(data))])
        if not isinstance(data, dict):
            return data, text
        source_file = str(p)
        my_pos = source.positions
        merged: Any = {}
        for name in _extends_list(data, source_file, my_pos, is_base=named_at is not None):
            line, col = my_pos.get(("extends",), (None, None))
            here = (source_file, line, col)
            problem = _base_problem(name, p.parent / name, root)
            if problem is not None:
                refuse(here, *problem)
            base, _ = load(p.parent / name, [*chain, resolved], here)
            if not isinstance(base, dict):  # an empty base (not-a-mapping is refused by the load)
                raise ConfigError(f"{p.parent / name}: a base config must be a mapping", [Finding(
                    "error", "schema.type", "the top level must be a mapping of sections", file=str(p.parent / name),
                    line=1, column=1, expected="a mapping (model:, data:, ...)", got=what_it_holds(base))])
            merged = _merge(merged, base, (), str(p.parent / name), {}, {})
        own = {k: v for k, v in data.items() if k != "extends"}
        for loc, pos in my_pos.items():
            if loc and loc[0] == "extends":
                continue
            positions[loc] = pos
            files[loc] = source_file
        layers.files.append(source_file)
        # every file claims its own keys (bases are loaded first, so later files win); only the top
        # file's replacements are "changed from the base"
        replaced = layers.base_values if named_at is None else {}
        return _merge(merged, own, (), source_file, layers.origin, replaced), text

    data, text = load(Path(path), [], None)
    return data, positions, files, text, layers


def config_sections() -> tuple[str, ...]:
    """The top-level keys of an apr config: its sections and ``extends``."""
    from apr.config.schema import AprConfig

    return (*AprConfig.model_fields, "extends")


def _exists(p: Path) -> bool:
    """Something is there (read_yaml says what is wrong with a FIFO, a loop or a folder)."""
    try:
        return os.path.lexists(p)
    except OSError:
        return False


def key_loc(key: str) -> tuple:
    """A dotted key path as a location: ``data.stages[1].weights.web`` -> ``("data", "stages", 1,
    "weights", "web")``."""
    out: list = []
    for part in key.split("."):
        m = re.fullmatch(r"([A-Za-z0-9_]+)\[(\d+)\]", part)
        out += [m.group(1), int(m.group(2))] if m else [part]
    return tuple(out)


MAX_SETTING_CHARS = 4096  # one KEY=VALUE's value, as typed


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=1e-3", "data.val=null"]`` -> ``{"optimizer.lr": 0.001, "data.val": None}``; values
    are read as YAML (numbers, booleans, null, flow lists and mappings), so they are typed as in a file."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    from apr.config.yamlfile import MAX_YAML_DEPTH, _flow_depth_exceeded

    out: dict[str, Any] = {}
    for arg in settings:
        m = SETTING.match(arg)
        if not m:
            raise ConfigError(f"not a KEY=VALUE setting: {arg!r}", [Finding(
                "error", "config.setting", "a command-line setting is a dotted key, '=', and a value",
                file=COMMAND_LINE, expected="KEY.PATH=VALUE, e.g. training.max_steps=100", got=repr(arg)[:80])])
        text = m["value"]

        def refuse(summary: str, expected: str, got: str, key: str = m["key"]) -> ConfigError:
            return ConfigError(f"setting {key}: {summary}", [Finding(
                "error", "config.setting", summary, path=key, file=COMMAND_LINE, expected=expected, got=got)])

        # bounded before YAML sees it: 100,000 digits or 5,000 brackets were a traceback in the parser
        if len(text) > MAX_SETTING_CHARS:
            raise refuse(f"the value is longer than {MAX_SETTING_CHARS:,} characters",
                         f"at most {MAX_SETTING_CHARS:,} characters", f"{len(text):,} characters")
        if _flow_depth_exceeded(text) is not None:
            raise refuse(f"the value nests brackets more than {MAX_YAML_DEPTH} levels deep",
                         f"at most {MAX_YAML_DEPTH} levels of [ ] and {{ }}", "deeper nesting")
        try:
            value = YAML(typ="safe", pure=True).load(text) if text.strip() else ""
        except YAMLError:
            value = text  # not YAML on its own: the plain string, as a file would hold it quoted
        except (ValueError, RecursionError):  # an integer past Python's 4,300-digit limit, and the like
            raise refuse("the value cannot be read as a number, a list or a mapping",
                         "a YAML value (numbers of at most 4,300 digits)", f"{len(text):,} characters") from None
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
