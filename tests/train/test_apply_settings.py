"""KEY=VALUE settings on `apr train apply`: the run uses them, records them, and a resume without a
setting that breaks exactness is refused with the settings to pass again."""

from __future__ import annotations

import pytest
from run_helpers import make_dataset, write_config

from apr.apply import run_apply
from apr.errors import AprError


def test_settings_shape_the_run_are_recorded_and_are_needed_again_to_resume(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 12, "eval_interval": 0, "save_interval": 2})
    quiet = {"apr_home": tmp_path / "home", "echo": lambda line: None}
    result = run_apply(cfg, settings=["training.max_steps=4", "training.seed=4"], **quiet)
    assert result.status == "finished" and result.final_step == 4
    with pytest.raises(AprError) as err:  # the seed is part of the run: resuming without it is refused
        run_apply(cfg, resume="latest", settings=["training.max_steps=6"], **quiet)
    # the checkpoint recorded the settings: the refusal says which to pass again
    assert "started with training.max_steps=4 training.seed=4" in err.value.message
    assert any(f.path == "training.seed" for f in err.value.findings)
    resumed = run_apply(cfg, resume="latest", settings=["training.max_steps=6", "training.seed=4"], **quiet)
    assert resumed.status == "finished" and resumed.start_step == 4 and resumed.final_step == 6


def test_a_key_given_as_an_option_and_as_a_setting_is_refused(tmp_path):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path)
    with pytest.raises(AprError, match="given twice"):
        run_apply(cfg, seed=1, settings=["training.seed=2"], apr_home=tmp_path / "home", echo=lambda line: None)
