"""Reading one YAML file, bounded, with each key's line and column (``SourceMap``): the reader
every config layer, contract file and settings file goes through
(docs/design.md, "Bounded reading")."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.errors import ConfigError, Finding
from apr.quoting import key_path, scrub
from apr.readers import read_text


@dataclass
class SourceMap:
    """Maps key paths (tuples) to 1-based (line, column) in the YAML file."""

    file: str
    positions: dict[tuple, tuple[int, int]] = field(default_factory=dict)
    files: dict[tuple, str] = field(default_factory=dict)  # key paths set in a base file or on the command line

    def locate(self, loc: tuple) -> tuple[int | None, int | None]:
        """Best position for ``loc``: the key itself, else its nearest ancestor present in the file."""
        loc = tuple(loc)
        while loc:
            if loc in self.positions:
                return self.positions[loc]
            loc = loc[:-1]
        return self.positions.get((), (None, None))

    def file_of(self, loc: tuple) -> str:
        """The file ``loc`` was read from: a base config it extends, "command line", or this file."""
        loc = tuple(loc)
        while loc:
            if loc in self.positions:
                return self.files.get(loc, self.file)
            loc = loc[:-1]
        return self.file

    def where(self, loc: tuple) -> tuple[str, int | None, int | None]:
        """(file, line, column) of ``loc``, for a finding."""
        return (self.file_of(loc), *self.locate(loc))


MAX_YAML_DEPTH = 32  # nesting levels (flow brackets and block indentation alike)
MAX_YAML_VALUES = 2_000  # values, counted before parsing (ruamel parses ~5k values a second) and
#                          again after expanding aliases: a few hundred bytes of nested aliases
#                          can otherwise expand to billions ("billion laughs")


class _TooMuchYaml(Exception):
    def __init__(self, code: str, message: str, loc: tuple, expected: str, got: str):
        super().__init__(message)
        self.code, self.message, self.loc, self.expected, self.got = code, message, loc, expected, got


def _plain(node: Any, loc: tuple, positions: dict, budget: list | None = None) -> Any:
    """Convert ruamel's round-trip nodes to plain Python, recording where every key sits.

    ``budget`` counts the values made (aliases are expanded here, so this is where an alias bomb
    would blow up); past MAX_YAML_VALUES values or MAX_YAML_DEPTH levels it raises _TooMuchYaml."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if budget is None:
        budget = [0]
    budget[0] += 1
    if budget[0] > MAX_YAML_VALUES:
        raise _TooMuchYaml("yaml.too_large", f"the document expands to more than {MAX_YAML_VALUES:,} values "
                           "(nested aliases?)", loc, f"at most {MAX_YAML_VALUES:,} values after expanding aliases",
                           f"more than {MAX_YAML_VALUES:,}")
    if isinstance(node, (CommentedMap, CommentedSeq)) and len(loc) >= MAX_YAML_DEPTH:
        raise _TooMuchYaml("yaml.too_deep", f"the document nests more than {MAX_YAML_DEPTH} levels deep", loc,
                           f"at most {MAX_YAML_DEPTH} levels of nesting", "deeper nesting")
    if isinstance(node, CommentedMap):
        positions.setdefault(loc, (node.lc.line + 1, node.lc.col + 1))
        out = {}
        for key, value in node.items():
            try:
                kl, kc = node.lc.key(key)
                positions[loc + (key,)] = (kl + 1, kc + 1)
            except (KeyError, TypeError, AttributeError):
                pass
            out[key] = _plain(value, loc + (key,), positions, budget)
        return out
    if isinstance(node, CommentedSeq):
        positions.setdefault(loc, (node.lc.line + 1, node.lc.col + 1))
        out_list = []
        for i, value in enumerate(node):
            try:
                il, ic = node.lc.item(i)
                positions[loc + (i,)] = (il + 1, ic + 1)
            except (KeyError, TypeError, AttributeError, IndexError):
                pass
            out_list.append(_plain(value, loc + (i,), positions, budget))
        return out_list
    if isinstance(node, bool) or node is None:
        return node
    if isinstance(node, int):
        return int(node)
    if isinstance(node, float):
        return float(node)
    if isinstance(node, str):
        return str(node)
    return node


_VALUE_START = re.compile(r"[,\[{]|^[ \t]*-(?=\s|$)|:(?=\s|$)", re.MULTILINE)


def _values_exceeded(text: str) -> int | None:
    """1-based line where a cheap count of value starts (``,``, ``[``, ``{``, ``- ``, ``: ``) passes
    MAX_YAML_VALUES, else None: an upper bound of what ruamel would build, so a dense file is
    refused before its parse alone takes seconds."""
    for n, m in enumerate(_VALUE_START.finditer(text), 1):
        if n > MAX_YAML_VALUES:
            return text.count("\n", 0, m.start()) + 1
    return None


def _flow_depth_exceeded(text: str) -> int | None:
    """1-based line where flow brackets (``[``/``{``) first nest deeper than MAX_YAML_DEPTH, else None.

    ruamel's scanner is quadratic in flow depth and its composer recursive, so ``[[[[...]]]]`` must
    be refused before parsing. Brackets inside quoted strings count too: a config never holds 32."""
    depth = 0
    for m in re.finditer(r"[\[\]{}]", text):
        if m.group() in "[{":
            depth += 1
            if depth > MAX_YAML_DEPTH:
                return text.count("\n", 0, m.start()) + 1
        elif depth:
            depth -= 1
    return None


def read_yaml(path: Path, kind: str = "config", what: str = "config file") -> tuple[Any, SourceMap, str]:
    """Read and parse ``path``. Raises ConfigError (with line and column) on any failure.

    Bounded (docs/design.md, "Bounded reading"): only a regular file of at most LIMITS[kind]
    bytes is read; nesting and alias expansion are capped before they can cost time or memory."""

    file = str(path)
    text = read_text(path, kind, what, error=ConfigError)
    line = _flow_depth_exceeded(text)
    if line is not None:
        raise ConfigError(f"{what} nests too deeply: {file}", [
            Finding("error", "yaml.too_deep", f"brackets nest more than {MAX_YAML_DEPTH} levels deep", file=file,
                    line=line, expected=f"at most {MAX_YAML_DEPTH} levels of nesting",
                    got=f"more than {MAX_YAML_DEPTH}")])
    line = _values_exceeded(text)
    if line is not None:
        raise ConfigError(f"{what} holds too many values: {file}", [
            Finding("error", "yaml.too_large", f"the document holds more than {MAX_YAML_VALUES:,} values",
                    file=file, line=line, expected=f"at most {MAX_YAML_VALUES:,} values",
                    got=f"more than {MAX_YAML_VALUES:,} (counted up to line {line})")])

    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    try:
        doc = yaml.load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        col = mark.column + 1 if mark else None
        # the parser quotes what it read (a duplicate key's values): scrubbed, as for any reader
        problem = scrub(" ".join(str(x) for x in (e.context, e.problem) if x)) or "invalid YAML"
        raise ConfigError(f"YAML syntax error in {file}", [
            Finding("error", "yaml.syntax", problem, file=file, line=line, column=col,
                    expected="valid YAML")]) from None
    except YAMLError as e:
        raise ConfigError(f"YAML error in {file}", [
            Finding("error", "yaml.syntax", scrub(str(e).splitlines()[0]) if str(e) else "invalid YAML",
                    file=file)]) from None
    except ValueError as e:  # an integer of more than 4,300 digits (Python's int-from-text limit), and the like
        raise ConfigError(f"{what} holds a value too large to read: {file}", [
            Finding("error", "yaml.too_large", scrub(str(e).split(";")[0]), file=file,
                    expected="numbers of at most 4,300 digits", got="a longer one")]) from None
    except RecursionError:  # block nesting ("- - - - ...") deep enough to exhaust the parser's stack
        raise ConfigError(f"{what} nests too deeply: {file}", [
            Finding("error", "yaml.too_deep", f"the document nests more than {MAX_YAML_DEPTH} levels deep",
                    file=file, expected=f"at most {MAX_YAML_DEPTH} levels of nesting",
                    got="far deeper nesting")]) from None
    positions: dict = {}
    try:
        data = _plain(doc, (), positions)
    except _TooMuchYaml as e:
        path_text = key_path(e.loc)
        line, col = SourceMap(file, positions).locate(e.loc)
        raise ConfigError(f"{what} is too large once parsed: {file}" if e.code == "yaml.too_large"
                          else f"{what} nests too deeply: {file}", [
            Finding("error", e.code, e.message, path=path_text, file=file, line=line, column=col,
                    expected=e.expected, got=e.got)]) from None
    return data, SourceMap(file, positions), text
