"""Shared fixtures. Every test gets a private APR_HOME so nothing touches the real ~/.apr."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# One intra-op thread per test process (and the runs they launch): `make test` runs 2 xdist workers
# on 2 cores beside torchrun jobs, and torch's default of a thread per core oversubscribed the CPU
# (a 5-second engine test took 70 s when a 2-rank job ran beside it). Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["home_guard"]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_apr_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("apr_home")
    monkeypatch.setenv("APR_HOME", str(home))
    monkeypatch.setenv("NO_COLOR", "1")
    yield home


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def shipped_configs() -> list[Path]:
    return sorted((REPO / "configs" / "train").glob("*.yaml"))


def apr_env() -> dict:
    env = dict(os.environ)
    env.setdefault("NO_COLOR", "1")
    return env


@pytest.fixture(scope="session")
def untrained_lm(tmp_path_factory):
    """The tiny LM of tests/generate/tiny_lm.py after 2 steps instead of 300 (a run directory, its
    checkpoint, an HF export, a tokenizer): for commands that measure or inspect a model rather than
    read what it learnt."""
    from tests.generate.tiny_lm import build

    return build(tmp_path_factory.mktemp("untrained_lm"), steps=2)
