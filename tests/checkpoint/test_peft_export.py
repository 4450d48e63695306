"""`apr export RUN --format peft`: the folder it writes loads with the real peft and transformers by
the very command it prints, and gives apr's own LoRA logits.

The adapters' base is exported as a Hugging Face folder inside the export (``base/``) unless
``--base HF_DIR`` names one; ``base_model_name_or_path`` is that folder's absolute path, so the
printed command works from any current folder (an apr run folder is not loadable by transformers).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.steps.resolved import resolve as plan_of
from tests.train.run_helpers import VOCAB, config_doc, make_dataset

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

runner = CliRunner()
LORA = {"rank": 4, "alpha": 8.0, "targets": "all"}
# Both sides run float32 on the CPU. Measured on this tiny model: max |difference| 0.0 (logits up to
# 1.06; the adapters move them by 0.38). 1e-5 leaves room only for a different order of sums (BLAS
# threads, another attention kernel) and stays far below the adapters' own effect (asserted
# > 1e-3 below), so a wrong base or a dropped adapter cannot pass.
ATOL = 1e-5


def _run(root, **sections):
    from apr.train.run import ApplyOptions, prepare_run

    cfg = AprConfig.model_validate(config_doc(root, **sections))
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(echo=lambda line: None))
    return run.execute()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A base pretrained 8 steps (root/base) and LoRA adapters trained on it 4 steps (root/lora)."""
    root = tmp_path_factory.mktemp("peft")
    make_dataset(root, train_rows=48, val_rows=8)
    common = {"epochs": 1, "eval_interval": 0, "save_interval": 4}
    assert _run(root, training={"max_steps": 8, "output_dir": "base/", **common}).final_step == 8
    assert _run(root, model={"init_from": str(root / "base"), "lora": LORA},
                training={"max_steps": 4, "output_dir": "lora/", **common}).final_step == 4
    return root


def _apr_logits(run_dir, ids):
    from apr.checkpoint.manager import load_latest
    from apr.train.build import build_engine

    state = load_latest(run_dir)
    cfg = AprConfig.model_validate(state.info.config)
    standard = cfg.model_copy(update={"training": cfg.training.model_copy(update={"engine": "standard"})})
    engine = build_engine(plan_of(standard))
    engine.load_train_state_tensors(state.tensors)
    with torch.no_grad():
        return engine.model(ids)


def _printed(output: str, label: str) -> str:
    match = re.search(rf"^\s*{label}: (.+)$", output, re.M)
    assert match, output
    return match.group(1)


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def test_the_printed_load_command_runs_and_gives_aprs_lora_logits(lora_run, tmp_path, monkeypatch):
    out = tmp_path / "lora-peft"
    result = runner.invoke(app, ["export", str(lora_run / "lora"), "--format", "peft", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "adapter_config.json").read_text())
    assert doc["base_model_name_or_path"] == str((out / "base").resolve())
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "base").iterdir()}

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = _apr_logits(lora_run / "lora", ids)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the printed paths are absolute: any current folder works
    for label in ("load with", "or"):
        namespace: dict = {}
        exec(_printed(result.output, label), namespace)  # the command exactly as printed
        model = namespace["model"]
        assert isinstance(model, peft.PeftModel)
        torch.testing.assert_close(_logits(model, ids), ours, atol=ATOL, rtol=0)
    with torch.no_grad(), model.disable_adapter():  # the adapters do change the output
        assert (_logits(model, ids) - ours).abs().max() > 1e-3


def test_base_names_an_existing_hf_folder_and_a_wrong_one_is_refused(lora_run, tmp_path):
    base_hf = tmp_path / "base-hf"
    first = runner.invoke(app, ["export", str(lora_run / "base"), "--out", str(base_hf),
                                "--tokenizer", str(_tokenizer(tmp_path))])
    assert first.exit_code == 0, first.output
    out = tmp_path / "adapters"
    result = runner.invoke(app, ["export", str(lora_run / "lora"), "--format", "peft", "--out", str(out),
                                 "--base", str(base_hf)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_hf.resolve())
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    namespace: dict = {}
    exec(_printed(result.output, "load with"), namespace)
    torch.testing.assert_close(_logits(namespace["model"], ids), _apr_logits(lora_run / "lora", ids), atol=ATOL,
                               rtol=0)
    # another model's weights as --base: refused, nothing written
    other = tmp_path / "other-hf"
    (other).mkdir()
    for f in base_hf.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    refused = runner.invoke(app, ["export", str(lora_run / "lora"), "--format", "peft", "--out",
                                  str(tmp_path / "x"), "--base", str(other)])
    assert refused.exit_code == 1 and "--base" in refused.output and "model.norm.weight" in refused.output
    assert not (tmp_path / "x").exists()
    assert runner.invoke(app, ["export", str(lora_run / "lora"), "--out", str(tmp_path / "y"), "--base",
                               str(base_hf)]).exit_code == 1  # --base is for --format peft


def test_a_peft_export_with_its_base_is_replaced_with_overwrite(lora_run, tmp_path):
    out = tmp_path / "p"
    args = ["export", str(lora_run / "lora"), "--format", "peft", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    assert runner.invoke(app, args).exit_code == 1  # exists
    again = runner.invoke(app, [*args, "--overwrite"])
    assert again.exit_code == 0, again.output
    (out / "base" / "notes.txt").write_text("mine")  # a user's file inside: never deleted
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 1
    assert (out / "base" / "notes.txt").read_text() == "mine"


def _tokenizer(tmp_path):
    from apr.plan.examples import write_tokenizer

    path = tmp_path / "tok.json"
    write_tokenizer(path, VOCAB)
    return path
