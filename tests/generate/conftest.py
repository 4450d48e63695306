from __future__ import annotations

import pytest

from tests.generate.tiny_lm import build


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny_lm"))
