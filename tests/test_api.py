"""apr/api.py: ``Trainer(config).fit()`` is the run ``apr train apply`` makes of the same config, and
``load_model`` gives a run folder's best or last model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from apr.api import Trainer, load_model
from apr.apply import run_apply
from apr.errors import AprError
from tests.train.run_helpers import config_doc, make_dataset, write_config

SECTIONS = {"training": {"max_steps": 4, "save_interval": 2, "eval_interval": 2, "warmup_steps": 1}}


def test_fit_on_a_dict_trains_as_apply_on_the_file_and_loads_the_best_and_last_models(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    doc = config_doc(tmp_path, **SECTIONS)
    lines: list[str] = []
    result = Trainer(doc, echo=lines.append, apr_home=tmp_path / "home").fit()
    assert result.status == "finished" and result.final_step == 4
    assert result.run_dir == tmp_path / "run"
    # the CLI's library call on the same config, as a file, into another folder: the same weights
    other = write_config(tmp_path, "other.yaml", training={**SECTIONS["training"], "output_dir": "other/"})
    direct = run_apply(other, apr_home=tmp_path / "home", echo=lambda line: None)
    mine = load_file(str(result.run_dir / "checkpoint-step-4.safetensors"))
    theirs = load_file(str(direct.run_dir / "checkpoint-step-4.safetensors"))
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)

    last = load_model(result.run_dir, "last")
    assert last.step == 4 and not last.model.training
    assert torch.equal(last.model.model.embed_tokens.weight, mine["model.embed_tokens.weight"])
    best = load_model(result.run_dir, which="best")
    assert best.step in (2, 4) and best.step == _best_step(result.run_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert best.model(ids).shape[-1] == doc["model"]["architecture"]["vocab_size"]


def _best_step(run_dir) -> int:
    import json

    return int(json.loads((run_dir / "checkpoint-best.json").read_text())["step"])


def test_settings_as_a_dict_are_apply_settings_and_the_plan_is_the_cli_plan(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    trainer = Trainer(write_config(tmp_path, **SECTIONS), settings={"training.max_steps": 2, "optimizer.lr": 1e-3},
                      apr_home=tmp_path / "home")
    plan = trainer.plan()
    assert not plan.errors and plan.config.training.max_steps == 2 and plan.config.optimizer.lr == 1e-3
    result = trainer.fit()
    assert result.final_step == 2


def test_bad_input_is_an_apr_error_with_findings(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    doc = config_doc(tmp_path, optimizer={"name": "adafactor"})  # the walk cannot run it: the plan refuses
    with pytest.raises(AprError) as err:
        Trainer(doc, apr_home=tmp_path / "home").fit()
    assert any(f.path == "optimizer.name" for f in err.value.findings)
    with pytest.raises(AprError, match="path or a config dict"):
        Trainer(42)
    with pytest.raises(AprError, match="'best' or 'last'"):
        load_model(tmp_path, which="first")
    with pytest.raises(AprError, match="no checkpoint-best.json"):
        load_model(tmp_path, which="best")
    with pytest.raises(AprError, match="not a run folder"):
        load_model(tmp_path / "missing")
