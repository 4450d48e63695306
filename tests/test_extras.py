"""pyproject.toml's extras stay installable (issue 54 item 13): pip's resolver, in --dry-run, finds a
set of versions for `.[dev,bench]` (bench: the peers benchmarks/bench_peers.py is measured against,
beside the test dependencies). It needs the package index: where pip cannot reach it the test skips,
saying so; where it can (CI), a conflict fails it with pip's own explanation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _pip(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--timeout", "10"],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _index_reachable() -> str | None:
    """None when pip can read the index, else why not."""
    try:
        probe = _pip("index", "versions", "litgpt", timeout=60)
    except subprocess.TimeoutExpired:
        return "pip could not read the package index within 60 s"
    if probe.returncode != 0 or "litgpt" not in probe.stdout:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return f"pip cannot reach the package index here ({last})"
    return None


@pytest.mark.slow
def test_the_bench_extra_resolves_beside_the_dev_extra():
    why = _index_reachable()
    if why:
        pytest.skip(why)
    try:
        proc = _pip("install", "--dry-run", "--quiet", "-e", ".[dev,bench]", timeout=240)
    except subprocess.TimeoutExpired:
        pytest.skip("pip's resolver ran over 240 s (a slow index): nothing learnt about the extras")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"pip cannot install .[dev,bench]:\n{out[-3000:]}"
    assert "ResolutionImpossible" not in out
