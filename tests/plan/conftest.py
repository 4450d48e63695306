"""Fixtures for the plan tests."""

from __future__ import annotations

import pytest

from apr.plan.examples import materialize


@pytest.fixture
def example_dir(tmp_path):
    """A clean base run (config, shards, tokenizer) that passes every error and warning contract."""
    config_path, _ = materialize({}, tmp_path / "base")
    return config_path

