"""Time conditioning on two data-parallel ranks (CPU, gloo): each row's time step depends on the
seed, the step and its tokens only, so DDP's all-reduce and FSDP2's shards (the time embedding in
the root unit with the token embedding) equal one process accumulating the same micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from apr.checkpoint.manager import read_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.ranks import launch_worker  # noqa: E402

TIME = {"embedding_dim": 8, "num_time_steps": 16, "encoding": "learned"}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])  # the layout in the id (apr/steps/composition.py)
def test_time_steps_on_two_ranks_equal_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=96)
    common = {"epochs": 1, "max_steps": 6, "save_interval": 6, "eval_interval": 3, "engine": "standard",
              "grad_clip": 0.5, "log_interval": 3}
    model, opt = {"architecture": {"time": TIME}}, {"lr": 3e-3, "min_lr": 3e-4}
    one = config_doc(tmp_path, model=model, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "gradient_accumulation": 2, "output_dir": "one/"})
    two = config_doc(tmp_path, model=model, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "sharding": sharding, "output_dir": "two/"})
    launch_worker(one, tmp_path / "one.json", 1)
    launch_worker(two, tmp_path / "two.json", 2)
    a, b = (read_checkpoint(tmp_path / d / "checkpoint-step-6.json").tensors for d in ("two", "one"))
    assert set(a) == set(b) and "model.time_embedding.table.weight" in a
    worst = max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in a)
    assert worst <= 1e-6, worst
