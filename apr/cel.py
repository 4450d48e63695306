"""The one CEL engine used by contracts (apr/plan) and alerts (apr/track): compile once, evaluate many.

Backed by the `common-expression-language` package (a Rust CEL implementation). Expressions are
sandboxed: no Python `eval`, no attribute access beyond the variables we pass.
"""

from __future__ import annotations

import re
import sys
import types
from functools import lru_cache
from typing import Any

from apr.errors import AprError


class CelError(AprError):
    """A CEL expression failed to compile or evaluate."""


def _cel_module():
    # The package's __init__ imports its interactive CLI (prompt_toolkit, ~200 ms); we never use it.
    sys.modules.setdefault("cel.cli", types.ModuleType("cel.cli"))
    import cel

    return cel


# Bounds checked before the CEL library sees an expression: its parser recurses per nesting level
# and panics (an uncatchable Rust abort surfaced as a Python BaseException) on ~100k parentheses.
MAX_EXPRESSION_CHARS = 4096
MAX_EXPRESSION_DEPTH = 32

# Macros whose first argument is a variable bound inside the macro: `[a, b].exists(x, x > 1)`.
_BINDING_MACRO = re.compile(r"\.\s*(?:exists_one|exists|all|map|filter)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*,")


def _nesting_depth(expression: str) -> int:
    depth = deepest = 0
    for ch in expression:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


def check_bounds(expression: str) -> None:
    """Raise CelError for an expression longer or more deeply nested than apr accepts."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CelError(f"CEL expression of {len(expression):,} characters: at most {MAX_EXPRESSION_CHARS:,} "
                       f"are accepted ({expression[:40]!r}...)")
    depth = _nesting_depth(expression)
    if depth > MAX_EXPRESSION_DEPTH:
        raise CelError(f"CEL expression nests {depth:,} levels deep: at most {MAX_EXPRESSION_DEPTH} are accepted "
                       f"({expression[:40]!r}{'...' if len(expression) > 40 else ''})")


@lru_cache(maxsize=1024)
def compile_expr(expression: str):
    """Compile a CEL expression, raising CelError with the parser's message on a syntax error."""
    check_bounds(expression)
    cel = _cel_module()
    try:
        return cel.compile(expression)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # ValueError/RuntimeError subclasses, or pyo3's PanicException
        raise CelError(f"invalid CEL expression {expression!r}: {e}") from None


def evaluate(expression: str, variables: dict[str, Any]) -> Any:
    """Evaluate ``expression`` with ``variables`` bound. Raises CelError on any failure."""
    program = compile_expr(expression)
    try:
        return program.execute(variables)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # an evaluation error, or pyo3's PanicException
        raise CelError(f"cannot evaluate {expression!r}: {e}") from None


def variables_of(expression: str) -> list[str]:
    """Top-level variable names an expression refers to (to check alert conditions up front)."""
    return list(compile_expr(expression).variables())


def free_variables(expression: str) -> list[str]:
    """``variables_of`` less the names bound by macros (``x`` in ``[loss, val_loss].exists(x, x > 9)``):
    the names that must come from outside the expression."""
    bound = set(_BINDING_MACRO.findall(expression))
    return [name for name in variables_of(expression) if name not in bound]
