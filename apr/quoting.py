"""What an error may quote of a file apr read: the one rule for every reader (configs and the bases
they extend, sweep files, dashboard files, task files, ...; docs/design.md, "Bounded reading").

A command can be pointed at any readable file (``--config /etc/shadow``, ``extends: ../.env``, a
sweep file's ``config:`` key, ``--dashboard ~/.netrc``), and its error output may land in a CI log
that others read. So an error names the file, the line and the key path, and quotes at most

* a key, when it is a name (letters, digits, ``_``, ``-``, ``.``; at most 128 characters),
* a short value (numbers, booleans, a printable string of at most ``MAX_VALUE_CHARS``
  characters), and only from a document of the expected kind,

and never a line, nor a value, of a file that did not parse as the kind it was read as: such a
file is refused whole (``not_of_kind``), saying what it holds in words ("a string of 31
characters"), never its text. Parser messages pass through ``scrub`` first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

MAX_VALUE_CHARS = 40
MAX_NUMBER_CHARS = 24
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
HIDDEN_KEY = "<a key that is not a name>"


def is_name(key: Any) -> bool:
    """A key that may be quoted: a short identifier-like name (``lr``, ``seq_len``, ``max-steps``)."""
    return isinstance(key, str) and bool(_NAME.fullmatch(key))


def key_text(key: Any) -> str:
    """The key as an error may print it: itself when a name, a list index as ``[i]``'s number,
    else a placeholder (a shadow line or ``API_KEY=...`` read as a key is never printed)."""
    if isinstance(key, bool):
        return HIDDEN_KEY
    if isinstance(key, int) and abs(key) < 10**9:
        return str(key)
    return key if is_name(key) else HIDDEN_KEY


def quote_key(key: Any) -> str:
    """``'lr'``, or the placeholder (unquoted) for a key that is not a name."""
    text = key_text(key)
    return text if text == HIDDEN_KEY else f"'{text}'"


def key_path(loc: Iterable) -> str:
    """A location as a dotted key path (``model.architecture.hidden_size``, ``data.sources[0]``), each
    part through ``key_text``."""
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + key_text(part)
    return out


def describe(value: Any, *, show: bool = True) -> str:
    """A value as an error may quote it: a kind in words for a mapping, a list or null; a short
    number, boolean or printable string as written (``show``: only for a document of the expected
    kind); anything else by its kind and length, never its text."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if value is None:
        return "null (empty value)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value) if not isinstance(value, int) or abs(value) < 10**MAX_NUMBER_CHARS else ""
        if show and text and len(text) <= MAX_NUMBER_CHARS:
            return text
        return f"a {'whole ' if isinstance(value, int) else ''}number (not shown)"
    if isinstance(value, str):
        if show and len(value) <= MAX_VALUE_CHARS and value.isprintable():
            return repr(value)
        n = len(value)
        return f"a string of {n:,} character{'s' if n != 1 else ''} (not shown)"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value):,} bytes (not shown)"
    return f"a {type(value).__name__} (not shown)"


def shown(value: Any) -> bool:
    """Whether ``describe(value)`` prints the value itself (short and printable)."""
    return not describe(value).endswith("(not shown)")


# A parser's message quotes what it read: "found duplicate key "password" with value "..."".
_WITH_VALUE = re.compile(r"\s*(?:with value\b|\(original value:).*$", re.S)
_QUOTED = re.compile(r"\"([^\"\n]*)\"|'([^'\n]*)'")


def scrub(message: str, limit: int = 200) -> str:
    """A parser's message without what it quotes of the file: a quoted name stays (a key, an alias),
    any other quoted text becomes ``'...'``, and a duplicate key's values are dropped."""
    text = _WITH_VALUE.sub("", str(message))

    def one(m: re.Match) -> str:
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        if is_name(inner) or (len(inner) <= 4 and inner.isprintable() and not inner.isalnum()):
            return m.group(0)  # a key, an alias, a character such as '\t' or ':'
        return "'...'"

    text = _QUOTED.sub(one, text)
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def of_kind(doc: Any, known: Iterable[str]) -> bool:
    """Whether parsed ``doc`` is a document of the expected kind: a mapping that is empty or names at
    least one ``known`` top-level key. A file that is not (``/etc/passwd`` read as a config, a
    ``.env`` read as a sweep file) is refused whole, by ``not_of_kind``."""
    if not isinstance(doc, dict):
        return False
    known = set(known)
    return not doc or any(isinstance(k, str) and k in known for k in doc)


def what_it_holds(doc: Any) -> str:
    """A document in words, for a refusal: never its text."""
    if isinstance(doc, dict):
        n = len(doc)
        return f"a mapping of {n} key{'s' if n != 1 else ''}, none of them known (not shown)"
    if isinstance(doc, list):
        return f"a list of {len(doc):,} item{'s' if len(doc) != 1 else ''} (not shown)"
    return describe(doc, show=False)
