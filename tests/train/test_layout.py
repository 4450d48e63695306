"""The run's layout (apr/train/layout.py): the config at the world size torchrun started, and a resume
on another number of ranks keeping the checkpoint's global batch, or refused naming the world sizes
that can."""

from __future__ import annotations

import pytest

from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.elastic import elastic_layout
from apr.steps.resolved import laid_out
from apr.steps.resolved import resolve as plan_of
from tests.train.tiny import make_config


def test_the_same_layout_is_the_same_config_and_another_is_a_new_validated_one():
    config = make_config()
    assert laid_out(config, 1) is config
    four = laid_out(config, 4, accumulation=2)
    assert (four.training.world_size, four.training.gradient_accumulation) == (4, 2)
    assert (config.training.world_size, config.training.gradient_accumulation) == (1, 1)  # never edited
    assert isinstance(four, AprConfig)


def _saved(tmp_path, world: int, accum: int) -> None:
    """A checkpoint of a run on ``world`` ranks x ``accum`` micro-batches in tmp_path/run."""
    from apr.checkpoint.manager import CheckpointManager, TrainState
    from apr.train.build import build_engine

    config = make_config(training={"world_size": world, "gradient_accumulation": accum, "engine": "standard",
                                   "output_dir": str(tmp_path / "run")})
    manager = CheckpointManager(tmp_path / "run", config)
    tensors = build_engine(plan_of(config)).train_state_tensors()
    manager.save(TrainState(step=2, tensors=tensors, meta={"run_id": "r1"}))


def test_a_resume_on_more_ranks_keeps_the_global_batch_or_names_the_world_sizes_that_can(tmp_path):
    _saved(tmp_path, world=2, accum=2)
    config = make_config(training={"output_dir": str(tmp_path / "run")})
    same = elastic_layout(laid_out(config, 2, 2), tmp_path / "run", "latest", 2)
    assert same is None
    four = elastic_layout(config, tmp_path / "run", "latest", 4)
    assert (four["from_accumulation"], four["to_accumulation"]) == (2, 1) and "keeps the global batch" in \
        four["message"]
    with pytest.raises(AprError) as err:
        elastic_layout(config, tmp_path / "run", "latest", 3)
    assert err.value.findings[0].path == "training.world_size" and "resume on 1, 2, 4 ranks" in err.value.message
    assert elastic_layout(config, tmp_path / "run", None, 4) is None  # not a resume
