"""The one CEL engine used by contracts (apr/plan) and alerts (apr/track): compile once, evaluate many.

Backed by the `common-expression-language` package (a Rust CEL implementation). Expressions are
sandboxed: no Python `eval`, no attribute access beyond the variables we pass.
"""

from __future__ import annotations

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


@lru_cache(maxsize=1024)
def compile_expr(expression: str):
    """Compile a CEL expression, raising CelError with the parser's message on a syntax error."""
    cel = _cel_module()
    try:
        return cel.compile(expression)
    except Exception as e:  # the extension raises ValueError/RuntimeError subclasses
        raise CelError(f"invalid CEL expression {expression!r}: {e}") from None


def evaluate(expression: str, variables: dict[str, Any]) -> Any:
    """Evaluate ``expression`` with ``variables`` bound. Raises CelError on any failure."""
    program = compile_expr(expression)
    try:
        return program.execute(variables)
    except Exception as e:
        raise CelError(f"cannot evaluate {expression!r}: {e}") from None


def variables_of(expression: str) -> list[str]:
    """Top-level variable names an expression refers to (to check alert conditions up front)."""
    return list(compile_expr(expression).variables())
