"""Load a YAML config with line numbers and validate it, collecting every error at once."""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from apr.config.auto import auto_message, fill_auto, is_auto, take_auto
from apr.config.layers import COMMAND_LINE, Layers, apply_settings, parse_settings, read_layered
from apr.config.schema import AprConfig
from apr.config.yamlfile import (  # noqa: F401  (re-exported: the readers import them from here)
    MAX_YAML_DEPTH,
    MAX_YAML_VALUES,
    SourceMap,
    read_yaml,
)
from apr.errors import ConfigError, Finding
from apr.quoting import describe, is_name, key_path, quote_key, shown, what_it_holds


@dataclass
class LoadedConfig:
    config: AprConfig
    path: Path
    raw: dict
    source: SourceMap
    text: str
    layers: Layers = field(default_factory=Layers)
    auto: tuple[str, ...] = ()  # the layout keys that said auto: stand-ins until the plan fits them

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)


def config_hash(config: AprConfig) -> str:
    """SHA-256 of the fully resolved config (defaults included), stable across key order."""
    return config_doc_hash(config.model_dump(mode="json"))


def config_doc_hash(doc: Any) -> str:
    """:func:`config_hash` of a config already dumped to JSON (as a checkpoint stores it)."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# Bounds on a YAML document, checked before and while it is turned into plain Python (see
# docs/design.md, "Bounded reading"): a real config has a few hundred values and nests 4 deep.
def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the keys at ``loc`` (for did-you-mean suggestions)."""

    cls: Any = AprConfig
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        # unwrap Optional[...] and list[...]
        for _ in range(3):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                break
            if args:
                ann = args[0]
        cls = ann
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


# Names Hugging Face's TrainingArguments (and habit) use for keys apr names otherwise.
_HF_NAMES = {"learning_rate": "lr", "num_train_epochs": "epochs", "max_grad_norm": "grad_clip",
             "gradient_accumulation_steps": "gradient_accumulation", "per_device_train_batch_size": "batch_size",
             "lr_scheduler_type": "lr_scheduler", "sequence_length": "seq_len", "max_seq_length": "seq_len",
             "train_batch_size": "batch_size", "steps": "max_steps"}


@functools.cache
def schema_key_paths() -> tuple[tuple[str, ...], ...]:
    """Every key path the schema knows (list items skipped: ``monitoring.alerts.condition``)."""
    out: list[tuple[str, ...]] = []

    def walk(cls: type[BaseModel], loc: tuple[str, ...]) -> None:
        for name in cls.model_fields:
            out.append((*loc, name))
            sub = _model_at((*loc, name))
            if sub is not None and len(loc) < MAX_YAML_DEPTH:
                walk(sub, (*loc, name))

    walk(AprConfig, ())
    return tuple(out)


def known_keys(section: tuple) -> list[str]:
    """The keys a file may write in ``section`` (a key path): the schema's fields, and at the top
    level ``extends``, which the loader reads (apr/config/layers.py) before the schema sees the file."""
    owner = _model_at(section)
    known = sorted(owner.model_fields) if owner else []
    return sorted([*known, "extends"]) if owner is AprConfig else known


def did_you_mean(loc: tuple) -> str:
    """``"; did you mean 'seq_len'?"`` for an unknown key at ``loc``: a close name in the same
    section, else a key of that name (or close to it) in another section, named by its whole path
    (``training.lr`` -> ``optimizer.lr``); '' when nothing is close."""
    name = str(loc[-1])
    close = difflib.get_close_matches(name, known_keys(loc[:-1]), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    paths = schema_key_paths()
    name = _HF_NAMES.get(name, name)
    same = [p for p in paths if p[-1] == name]
    if not same:
        leaves = difflib.get_close_matches(name, sorted({p[-1] for p in paths}), n=1, cutoff=0.75)
        same = [p for p in paths if leaves and p[-1] == leaves[0]]
    if not same:
        return ""
    where = tuple(p for p in loc[:-1] if isinstance(p, str))
    # the candidate sharing the most leading sections with where the key was written, then the shortest
    best = sorted(same, key=lambda p: (-sum(1 for a, b in zip(p, where, strict=False) if a == b), len(p), p))[:2]
    names = " or ".join(f"'{'.'.join(p)}'" for p in best)
    return f"; did you mean {names}?"


def _describe(value: Any) -> str:
    return describe(value)  # the one rule of what an error may quote (apr/quoting.py)


_UNION_TAG = re.compile(r"^(str|int|float|[\w-]+\[.*\])$")


def _finding_from_error(err: dict, source: SourceMap) -> Finding:
    # pydantic names the member of a union it tried ('str', 'list[DataSource]') after the union's
    # key: not a key of the file. Only after the first element (a top-level key is always the user's).
    loc = _user_loc(err["loc"])
    path = key_path(loc)  # a key that is not a name (a line of another file read as a key) is not printed
    file, line, col = source.where(loc)
    etype = err["type"]
    got = _describe(err.get("input"))
    if etype == "extra_forbidden":
        known = known_keys(loc[:-1])
        hint = did_you_mean(loc)
        hint = hint if is_name(loc[-1]) else ""
        return Finding("error", "schema.unknown_key", f"unknown key {quote_key(loc[-1])}{hint}", path=path,
                       file=file, line=line, column=col,
                       expected="one of: " + ", ".join(known) if known else None, got=quote_key(loc[-1]))
    if etype == "missing":
        return Finding("error", "schema.missing", f"required key '{loc[-1]}' is missing", path=path,
                       file=file, line=line, column=col, expected=f"a value for '{loc[-1]}'",
                       got="nothing")
    expected = None
    msg = err["msg"]
    if etype == "finite_number":
        expected = "a finite number (not .inf, .nan or beyond ±1.8e308)"
    elif etype == "enum":
        expected = "one of " + err.get("ctx", {}).get("expected", "")
    elif etype == "value_error":
        msg = msg.removeprefix("Value error, ")
        if "expected" in msg:
            expected = msg.split("expected", 1)[1].split(", got", 1)[0].strip()
    elif "ctx" in err:
        ctx = err["ctx"]
        for key, word in (("gt", "greater than"), ("ge", "at least"), ("lt", "less than"), ("le", "at most")):
            if key in ctx:
                expected = f"a number {word} {ctx[key]}"
    if expected is None:
        expected = msg[0].lower() + msg[1:] if msg else None
    if is_auto(err.get("input")) and etype != "extra_forbidden":
        msg = auto_message(path)
    if file not in (source.file, COMMAND_LINE):  # a base config: say where, never what it holds
        msg, got = _VALUE_TAIL.sub("", msg), "a value in a base config (not shown)"
    elif not shown(err.get("input")):  # too long, or not printable: a validator's ", got ..." goes too
        msg = _VALUE_TAIL.sub("", msg)
    return Finding("error", f"schema.{etype}", msg, path=path, file=file, line=line, column=col,
                   expected=expected, got=got)


# ", got 'the value'" at the end of a validator's message: left out for a value from a base file,
# which may not be an apr config at all (`extends: ../../.env`), so an error never prints its content.
_VALUE_TAIL = re.compile(r"[,;:(]?\s*\bgot\b.*$", re.S)


def validate_data(data: Any, source: SourceMap) -> AprConfig:
    """Validate parsed YAML against the schema, raising one ConfigError listing every problem."""
    if data is None:
        raise ConfigError(f"config is empty: {source.file}", [
            Finding("error", "schema.empty", "the file holds no YAML document", file=source.file, line=1,
                    column=1, expected="a mapping with sections model, data, optimizer, training",
                    got="an empty document")])
    if not isinstance(data, dict):
        line, col = source.positions.get((), (1, 1))
        raise ConfigError(f"config is not a mapping: {source.file}", [
            Finding("error", "schema.type", "the top level must be a mapping of sections", file=source.file,
                    line=line, column=col, expected="a mapping (model:, data:, ...)", got=what_it_holds(data))])
    try:
        return AprConfig.model_validate(data)
    except ValidationError as e:
        findings = [_finding_from_error(err, source) for err in e.errors()]
        findings.sort(key=lambda f: (f.line or 0, f.column or 0))
        n = len(findings)
        raise ConfigError(f"{source.file}: {n} schema error{'s' if n != 1 else ''}", findings) from None


def load_config(path: str | Path, settings: list[str] | dict | None = None) -> LoadedConfig:
    """Read, parse and validate a config file, the bases it ``extends`` and the command-line
    ``settings`` (``["optimizer.lr=1e-3"]``; apr/config/layers.py). Raises ConfigError listing every
    problem found."""
    path = Path(path)
    data, source, text, layers = _read_layered(path, settings)
    data, autos = take_auto(data)
    config = fill_auto(validate_data(data, source), autos, source)
    return LoadedConfig(config=config, path=path, raw=data, source=source, text=text, layers=layers, auto=autos)


@dataclass
class PartialConfig:
    """What `apr train validate` can still check in a config that fails the schema: the schema
    error, and (where one can be built) the config with every bad value taken out, its default or a
    placeholder in its place. ``tainted`` holds the key paths whose value is not the user's: a check
    that reads one of them (or a key under or above it) is not run."""

    error: ConfigError
    loaded: LoadedConfig | None = None
    tainted: frozenset[tuple] = frozenset()


def load_config_partial(path: str | Path, settings: list[str] | dict | None = None) -> LoadedConfig | PartialConfig:
    """``load_config``, but a schema error returns a PartialConfig instead of raising, so that the
    checks whose inputs are valid run in the same round (YAML, ``extends`` and setting errors still
    raise: there is no config to check)."""
    path = Path(path)
    data, source, text, layers = _read_layered(path, settings)
    data, autos = take_auto(data)
    try:
        config = fill_auto(validate_data(data, source), autos, source)
    except ConfigError as err:
        if not isinstance(data, dict) or not err.findings or not all(
                f.code.startswith("schema.") for f in err.findings):
            return PartialConfig(err)
        salvaged, tainted = _salvage(data)
        if salvaged is None:
            return PartialConfig(err, tainted=frozenset(tainted))
        loaded = LoadedConfig(config=salvaged, path=path, raw=data, source=source, text=text, layers=layers)
        return PartialConfig(err, loaded, frozenset(tainted))
    return LoadedConfig(config=config, path=path, raw=data, source=source, text=text, layers=layers, auto=autos)


def _read_layered(path: Path, settings: list[str] | dict | None) -> tuple[Any, SourceMap, str, Layers]:
    data, positions, files, text, layers = read_layered(path)
    source = SourceMap(str(path), positions, files)
    parsed = parse_settings(settings) if isinstance(settings, list) else dict(settings or {})
    if parsed:
        data = apply_settings(data, parsed, layers)
        for key in parsed:  # the key and any section it created are the command line's, with no line
            parts = tuple(key.split("."))
            for i in range(1, len(parts) + 1):
                if parts[:i] not in source.positions or i == len(parts):
                    source.positions[parts[:i]] = (None, None)
                    source.files[parts[:i]] = COMMAND_LINE
    return data, source, text, layers


# Values tried in place of a required key that is missing or was taken out (the first the schema
# accepts): a section, a count, a name, a number, a list. Checks never read them (they are tainted).
_PLACEHOLDERS: tuple = ({}, 64, "placeholder", 1.0, [])
_SALVAGE_ROUNDS = 8


def _salvage(data: dict) -> tuple[AprConfig | None, set[tuple]]:
    """(the config with every invalid value removed, or None when none can be built; the key paths
    whose value is not the user's). An unknown key is dropped without taint: it set nothing."""
    patched = copy.deepcopy(data)
    tainted: set[tuple] = set()
    for _ in range(_SALVAGE_ROUNDS):
        try:
            return AprConfig.model_validate(patched), tainted
        except ValidationError as e:
            errors = e.errors()
        for err in sorted(errors, key=lambda err: len(_user_loc(err["loc"]))):
            loc = _user_loc(err["loc"])
            if not loc:
                return None, tainted
            if err["type"] == "missing":
                if not _fill(patched, loc):
                    return None, tainted
                tainted.add(loc)
                continue
            if err["type"] != "extra_forbidden":
                tainted.add(_owning_key(loc))
            _remove(patched, _owning_key(loc) if err["type"] != "extra_forbidden" else loc)
    return None, tainted


def _user_loc(raw: tuple) -> tuple:
    """A pydantic error location without the union members it names ('str', 'list[DataSource]')."""
    raw = tuple(raw)
    return raw[:1] + tuple(p for p in raw[1:] if not (isinstance(p, str) and _UNION_TAG.match(p)))


def _owning_key(loc: tuple) -> tuple:
    """The innermost mapping key at or above ``loc``: a bad list item takes its list out whole, so
    the items after it keep their places (and their lines)."""
    for i in range(len(loc) - 1, -1, -1):
        if isinstance(loc[i], int):
            return loc[:i]
    return loc


def _remove(data: dict, loc: tuple) -> None:
    node: Any = data
    for part in loc[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(node, dict):
        node.pop(loc[-1], None)


def _fill(data: dict, loc: tuple) -> bool:
    """Put the first placeholder the schema accepts at ``loc`` (a missing required key)."""
    node: Any = data
    for part in loc[:-1]:
        if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return False
    if not isinstance(node, dict):
        return False
    for value in _PLACEHOLDERS:
        node[loc[-1]] = copy.deepcopy(value)
        try:
            AprConfig.model_validate(data)
            return True
        except ValidationError as e:
            if not any(_user_loc(err["loc"])[:len(loc)] == loc for err in e.errors()):
                return True
    return False
