"""apply decides the run's layout before it plans (apr/apply.py ``_layout``): the world size
torchrun started and, resuming a checkpoint of another world size, the gradient accumulation that
keeps its global batch, as settings the plan is built with; the run edits nothing."""

from __future__ import annotations

from apr.apply import _layout
from tests.train.test_layout import _saved
from tests.train.tiny import make_config


def test_a_resume_on_another_world_size_is_planned_with_the_accumulation_that_keeps_the_batch(tmp_path):
    _saved(tmp_path, world=2, accum=2)
    config = make_config(training={"output_dir": str(tmp_path / "run")})
    settings, elastic = _layout(config, "latest", 4)
    assert settings == {"training.world_size": 4, "training.gradient_accumulation": 1}
    assert (elastic["from_world_size"], elastic["to_world_size"]) == (2, 4)
    settings, elastic = _layout(config, None, 4)  # a fresh run: only the world size
    assert settings == {"training.world_size": 4} and elastic is None
    assert _layout(config, None, 1) == ({}, None)  # one process, as configured
