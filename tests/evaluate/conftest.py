from __future__ import annotations

import pytest

from tests.generate.tiny_lm import session_tiny_lm


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    return session_tiny_lm(tmp_path_factory)


@pytest.fixture(scope="session")
def loaded(tiny_lm):
    from apr.generate.load import load_for_inference

    return load_for_inference(tiny_lm.checkpoint)
