"""tests/train is a package (its test_engine.py and test_blame.py share their names with tests in
tests/profile and tests/track), and its modules import their siblings by plain name (run_helpers,
tiny, the worker scripts) as they did before it was one: this folder stays on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
