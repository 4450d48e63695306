"""Human-friendly numbers in configs: ``32_768``, ``512K``, ``10B``, ``1.5M`` and byte sizes ``24GiB``."""

from __future__ import annotations

import re

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]+)?(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)

_BYTE_SUFFIX = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]+)?)\s*([A-Za-z]*)\s*$")


# Upper bounds shared by every count and size: beyond them a value is a typo (``1e20``), and
# arithmetic on it would overflow floats or lose precision in JSON.
MAX_COUNT = 2**53  # every integer up to here is exact as a float and in JSON
MAX_BYTES = 2**60  # 1 EiB
MIN_BARE_BYTES = 2**20  # a unitless memory size below 1 MiB is a missing unit, not a size


def parse_count(value: object, *, maximum: int = MAX_COUNT) -> int:
    """Parse a count. Integers pass; strings may use ``_`` separators and K/M/B/T suffixes.

    Raises ValueError with a message naming what was expected.
    """
    n = _count(value)
    if abs(n) > maximum:
        raise ValueError(f"expected a count of at most {maximum:,}, got {value!r}")
    return n


def _count(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a count (integer such as 32768, 32_768 or 512K), got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(f"expected a whole number, got {value!r}")
    if isinstance(value, str):
        m = _COUNT_RE.match(value)
        if m:
            number = float(m.group(1).replace("_", "")) if ("." in m.group(1) or "e" in m.group(1).lower()) \
                else int(m.group(1).replace("_", ""))
            scaled = number * _COUNT_SUFFIX[m.group(2).upper()]
            if float(scaled).is_integer():
                return int(scaled)
            raise ValueError(f"expected a whole number, got {value!r} (= {scaled})")
    raise ValueError(f"expected a count such as 32768, 32_768, 512K, 1.5M or 10B, got {value!r}")


def parse_bytes(value: object) -> int:
    """Parse a memory size: ``24GiB``, ``80GB``, ``24G`` (binary), ``512B``, or a plain byte count of
    at least 1 MiB. A bare number below 1 MiB (``24``) is refused: it is a size missing its unit."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 24GiB, got a boolean")
    unit = ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _BYTES_RE.match(value)) and m.group(2).upper() in _BYTE_SUFFIX:
        unit = m.group(2)
        n = int(float(m.group(1).replace("_", "")) * _BYTE_SUFFIX[unit.upper()])
    else:
        raise ValueError(f"expected a memory size such as 24GiB, 80GB or 16G, got {value!r}")
    if not unit and 0 <= n < MIN_BARE_BYTES:
        raise ValueError(f"expected a memory size with a unit such as {n}GiB or {n}GB, got {value!r} "
                         f"(a bare number is bytes: {value!r} would mean {n} bytes)")
    if n <= 0 or n > MAX_BYTES:
        raise ValueError(f"expected a memory size between 1 byte and 1 EiB, got {value!r}")
    return n
