"""Progressive stacking (model.stacking): the grow step's mechanics, a 2 -> 4 block run that resumes
bitwise across a kill -9 in stage 2 and exports to Hugging Face, freezing, the plan's stages, and
bad schedules refused with their key path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.build import resolve_config
from apr.steps.stacking import config_at
from apr.train.run import ApplyOptions, prepare_run
from apr.train.stacking import frozen_groups, grown_tensors, sources
from tests.distributed.ranks import run_apr
from tests.train.run_helpers import VOCAB, config_doc, make_dataset, run_until
from tests.train.tiny import make_config

WORKER = Path(__file__).resolve().parent / "run_worker.py"
STACKING = {"stages": [{"blocks": 2, "steps": 6}, {"blocks": 4}], "init": "copy_top"}


def _cfg(root: Path, stacking: dict | None = None, engine: str = "interleaved", lora: dict | None = None,
         **training) -> Path:
    arch = {"num_hidden_layers": 4}
    doc = config_doc(root, model={"architecture": arch, "stacking": stacking or STACKING, "lora": lora},
                     training={"max_steps": 12, "save_interval": 3, "log_interval": 1, "eval_interval": 6,
                               "engine": engine, **training})
    path = root / "cfg.json"
    path.write_text(json.dumps(doc))
    return path


def _run(cfg: Path, root: Path, resume: bool = False, kill_at: str | None = None) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_HOME": str(root / "home")}
    code, seen = run_until([sys.executable, str(WORKER), str(cfg)] + (["latest"] if resume else []), env, kill_at)
    assert code == (-signal.SIGKILL if kill_at is not None else 0), "".join(seen[-20:])
    return seen


def _weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(root / "run" / f"checkpoint-step-{step}.safetensors"))


def test_new_blocks_copy_the_top_block_with_fresh_moments():
    old = {}
    for i in range(2):
        for name in ("model.layers.{}.mlp.up_proj.weight", "optimizer.m.model.layers.{}.mlp.up_proj.weight"):
            old[name.format(i)] = torch.full((2, 2), float(i + 1) * (10 if "optimizer" in name else 1))
    old["model.embed_tokens.weight"] = torch.ones(3)
    new = {k.replace("layers.1", f"layers.{j}"): torch.full((2, 2), -1.0) for k in old if "layers.1" in k
           for j in range(4)}
    new["model.embed_tokens.weight"] = torch.zeros(3)
    got = grown_tensors(old, new, 2, 4, "copy_top")
    assert got["model.embed_tokens.weight"].equal(old["model.embed_tokens.weight"])
    for j, src in enumerate([0, 1, 1, 1]):
        assert got[f"model.layers.{j}.mlp.up_proj.weight"].equal(old[f"model.layers.{src}.mlp.up_proj.weight"])
    m1 = "optimizer.m.model.layers.1.mlp.up_proj.weight"
    assert got[m1].equal(old[m1])  # the top block's first copy (itself) keeps its moments
    assert all(got[f"optimizer.m.model.layers.{j}.mlp.up_proj.weight"].eq(0).all() for j in (2, 3))
    assert sources(2, 4, "interpolate") == [0, 0, 1, 1] and sources(2, 4, "fresh") == [0, 1, None, None]
    fresh = grown_tensors(old, new, 2, 4, "fresh")
    assert fresh["model.layers.3.mlp.up_proj.weight"].eq(-1).all()  # the new engine's own init


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    make_dataset(root)
    lines = _run(_cfg(root), root)
    return root, lines


def test_the_model_grows_at_the_planned_step_and_checkpoints_hold_each_stages_depth(uninterrupted):
    root, lines = uninterrupted
    assert any(line.startswith("step  7/12  stacking stage 1 starts at step 7: 2 -> 4 blocks") for line in lines)
    layers = lambda w: len({k.split(".")[2] for k in w if k.startswith("model.layers.")})  # noqa: E731
    assert layers(_weights(root, 6)) == 2 and layers(_weights(root, 9)) == 4 and layers(_weights(root, 12)) == 4
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert state["status"] == "finished"
    assert [(e["kind"], e["step"], e["detail"]["blocks"]) for e in state["events"]] == [("stack", 7, 4)]


def test_kill_9_in_stage_2_resumes_bitwise(uninterrupted, tmp_path):
    root, _ = uninterrupted
    make_dataset(tmp_path)
    cfg = _cfg(tmp_path)
    _run(cfg, tmp_path, kill_at="step 11/12")  # checkpoint of step 9 (stage 2) is the newest
    _run(cfg, tmp_path, resume=True)
    want, got = _weights(root, 12), _weights(tmp_path, 12)
    assert set(want) == set(got) and all(got[k].equal(want[k]) for k in want)


def test_a_kill_before_the_boundary_resumes_into_the_grow_bitwise(uninterrupted, tmp_path):
    root, _ = uninterrupted
    make_dataset(tmp_path)
    cfg = _cfg(tmp_path)
    _run(cfg, tmp_path, kill_at="step  7/12")  # the newest checkpoint is step 6: the 2-block stage
    _run(cfg, tmp_path, resume=True)
    want, got = _weights(root, 12), _weights(tmp_path, 12)
    assert all(got[k].equal(want[k]) for k in want)


def test_the_grown_model_exports_to_hugging_face_and_loads(uninterrupted, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from apr.checkpoint.export import export_hf
    from apr.data.standin import write_tokenizer
    from apr.generate.load import load_for_inference

    root, _ = uninterrupted
    tok = write_tokenizer(tmp_path / "tokenizer.json", VOCAB)
    for step, depth in ((12, 4), (6, 2)):  # the final model, and a checkpoint of the first stage
        out = tmp_path / f"hf{step}"
        export_hf(root / "run" / f"checkpoint-step-{step}.json", out, tokenizer=tok)
        model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        assert model.config.num_hidden_layers == depth
        ours = load_for_inference(root / "run" / f"checkpoint-step-{step}.json", tokenizer=tok, device="cpu")
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ours.model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ["interleaved", "standard"])
def test_freeze_keeps_the_earlier_blocks_as_they_were(tmp_path, engine):
    make_dataset(tmp_path)
    cfg = _cfg(tmp_path, {**STACKING, "earlier": "freeze"}, engine=engine, max_steps=9)
    _run(cfg, tmp_path)
    before, after = _weights(tmp_path, 6), _weights(tmp_path, 9)
    for name, value in before.items():
        if name.startswith(("model.layers.0.", "model.layers.1.", "optimizer.m.model.layers.0.",
                            "optimizer.v.model.layers.1.")):
            assert after[name].equal(value), name  # frozen: neither weights nor moments move
    assert not after["model.layers.3.mlp.up_proj.weight"].equal(after["model.layers.1.mlp.up_proj.weight"])
    assert not after["model.embed_tokens.weight"].equal(before["model.embed_tokens.weight"])  # still trains


def _cli(root: Path, *args) -> subprocess.CompletedProcess:
    """``python -m apr ARGS`` in ``root``, forked from the test worker's server (tests/distributed/ranks.py)."""
    env = {**os.environ, "APR_HOME": str(root / "home")}
    return run_apr(list(args), env, cwd=root)


def test_the_plan_shows_every_stage(tmp_path):
    make_dataset(tmp_path)
    cfg = _cfg(tmp_path)
    proc = _cli(tmp_path, "train", "plan", str(cfg), "--json", "--gpu", "H100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads(proc.stdout)["facts"]
    stages = facts["stacking"]["stages"]
    assert [(s["blocks"], s["first_step"], s["end_step"], s["steps"]) for s in stages] == [(2, 1, 6, 6), (4, 7, 12, 6)]
    assert stages[1]["params"] == facts["model"]["params"] and stages[0]["params"] < stages[1]["params"]
    assert stages[0]["memory_total_bytes"] < stages[1]["memory_total_bytes"]
    assert facts["stacking"]["total_flops"] < facts["time"]["total_flops"]  # shallow steps are cheaper
    text = _cli(tmp_path, "train", "plan", str(cfg)).stdout
    assert "stage 0: 2 blocks: steps 1-6" in text and "stage 1: 4 blocks: steps 7-12" in text


@pytest.mark.parametrize("stacking, path", [
    ({"stages": [{"blocks": 4, "steps": 5}, {"blocks": 2}]}, "model.stacking.stages[1].blocks"),  # shrinks
    ({"stages": [{"blocks": 2, "steps": 5}, {"blocks": 3}]}, "model.stacking.stages[1].blocks"),  # not the model
    ({"stages": [{"blocks": 2}, {"blocks": 4}]}, "model.stacking.stages[0].steps"),
    ({"stages": []}, "model.stacking.stages"),
    ({"stages": [{"blocks": 2, "steps": 50}, {"blocks": 4}]}, "model.stacking.stages[0].steps"),  # never starts
    ({"stages": [{"blocks": 2, "steps": 5}, {"blocks": 4}], "init": "interpolate", "earlier": "freeze"},
     "model.stacking.earlier"),
    ({"stages": [{"blocks": 2, "steps": 5}, {"blocks": 4}], "init": "interpolate", "building_mode": "prepend"},
     "model.stacking.building_mode"),
    ({"stages": [{"blocks": 2, "steps": 5}, {"blocks": 4}], "adapter_pattern": {"rank": "increasing"}},
     "model.stacking.adapter_pattern"),  # no trunk adapters to pattern
    ({"stages": [{"blocks": 2, "steps": 5}, {"blocks": 4, "adapters": {"rank": 2}}], "earlier": "freeze",
      "trunk_lora": {"rank": 4}}, "model.stacking.stages[1].adapters"),  # the last stage never joins the trunk
    ({"stages": [{"blocks": 2, "steps": 2}, {"blocks": 3, "steps": 2}, {"blocks": 4}], "earlier": "freeze",
      "trunk_lora": {"rank": 1}, "adapter_pattern": {"rank": "decreasing"}},
     "model.stacking.adapter_pattern.rank"),  # stage 1's blocks: rank 1 / 2
])
def test_bad_schedules_are_findings_with_their_key(tmp_path, stacking, path):
    make_dataset(tmp_path)
    proc = _cli(tmp_path, "train", "plan", str(_cfg(tmp_path, stacking)))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert path in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_prepend_moves_the_old_blocks_up_with_their_moments_and_copies_the_top_below():
    old = {f"{p}model.layers.{i}.mlp.up_proj.weight": torch.full((2, 2), float(i + 1) * (10 if p else 1))
           for i in range(2) for p in ("", "optimizer.m.")}
    new = {f"{p}model.layers.{j}.mlp.up_proj.weight": torch.full((2, 2), -1.0)
           for j in range(5) for p in ("", "optimizer.m.")}
    assert sources(2, 5, "copy_top", "prepend") == [1, 1, 1, 0, 1]
    assert sources(2, 5, "fresh", "prepend")[:3] == [None] * 3
    got = grown_tensors(old, new, 2, 5, "copy_top", "prepend")
    w, m = "model.layers.{}.mlp.up_proj.weight", "optimizer.m.model.layers.{}.mlp.up_proj.weight"
    for j in (0, 1):  # old block j is block 3 + j, weights and moments
        assert got[w.format(3 + j)].equal(old[w.format(j)]) and got[m.format(3 + j)].equal(old[m.format(j)])
    for j in range(3):  # the new stack: copies of the old top block, their own (zero) moments
        assert got[w.format(j)].equal(old[w.format(1)]) and got[m.format(j)].eq(0).all()
    fresh = grown_tensors(old, new, 2, 5, "fresh", "prepend")
    assert fresh[w.format(0)].eq(-1).all() and fresh[w.format(4)].equal(old[w.format(1)])


def test_a_stack_is_frozen_in_the_optimizer_until_a_later_stage_stores_it_in_its_precision():
    config = make_config(model={"architecture": {"num_hidden_layers": 4}, "stacking": {
        "stages": [{"blocks": 2, "steps": 3}, {"blocks": 3, "steps": 3, "precision": "bf16"}, {"blocks": 4}],
        "earlier": "freeze"}})
    assert frozen_groups(config, 5) == {"block.0", "block.1"}  # stage 1: the fp32 trunk stays in its groups
    assert frozen_groups(config, 8) == set()  # stage 2: block 2 is stored in bf16, outside the groups
    assert str(config_at(config, 2).training.engine) == "standard"  # every stage on the plan's source


def _inproc(root: Path, resume: str | None = None, **stacking):
    doc = config_doc(root, model={"architecture": {"num_hidden_layers": 4},
                                  "stacking": {**STACKING, **stacking}},
                     training={"max_steps": 9, "save_interval": 3, "eval_interval": 0, "log_interval": 3})
    cfg = AprConfig.model_validate(doc)
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(resume=resume, echo=lambda line: None, handle_signals=False))
    assert run.execute().status == "finished"
    return run


def _peft_logits(checkpoint: Path, out: Path, tok: Path, ids: torch.Tensor, **options) -> torch.Tensor:
    """``apr export --format peft`` of a stacked run's checkpoint, loaded with the real peft onto the
    base it wrote (or ``base``), as a user would: the adapted model's logits."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from apr.checkpoint.export import export_hf

    result = export_hf(checkpoint, out, tokenizer=tok, fmt="peft", **options)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(result.base)), str(out)).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_prepend_freeze_keeps_the_old_stack_on_top_resumes_across_the_grow_and_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from apr.checkpoint.export import export_hf
    from apr.data.standin import write_tokenizer
    from apr.generate.load import load_for_inference

    make_dataset(tmp_path)
    _inproc(tmp_path, building_mode="prepend", earlier="freeze")
    before, after = _weights(tmp_path, 6), _weights(tmp_path, 9)
    for name, value in before.items():  # the 2-block stage's blocks 0, 1 are blocks 2, 3 and frozen
        for j in (0, 1):
            if f"model.layers.{j}." in name:
                assert after[name.replace(f"layers.{j}.", f"layers.{j + 2}.")].equal(value), name
    assert not after["model.layers.0.mlp.up_proj.weight"].equal(before["model.layers.1.mlp.up_proj.weight"])
    for step in (6, 9):  # the newest checkpoint is now step 3: resume across the grow
        for f in (tmp_path / "run").glob(f"checkpoint-step-{step}.*"):
            f.unlink()
    _inproc(tmp_path, resume="latest", building_mode="prepend", earlier="freeze")
    assert all(_weights(tmp_path, 9)[k].equal(v) for k, v in after.items())
    tok = write_tokenizer(tmp_path / "tokenizer.json", VOCAB)
    export_hf(tmp_path / "run" / "checkpoint-step-9.json", tmp_path / "hf", tokenizer=tok)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = load_for_inference(tmp_path / "run" / "checkpoint-step-9.json", tokenizer=tok, device="cpu")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours.model(ids), rtol=1e-4, atol=1e-4)


def test_a_qlora_trunk_keeps_its_nf4_codes_trains_its_adapters_resumes_bitwise_and_exports_merged(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    from apr.generate.load import load_for_inference

    make_dataset(tmp_path)
    qlora = {"stages": [{"blocks": 2, "steps": 4}, {"blocks": 4}], "earlier": "freeze", "trunk_strategy": "qlora"}
    run = _inproc(tmp_path, **qlora)
    assert run.engine.source == "standard"  # the plan's choice for a transformed trunk
    at6, at9 = _weights(tmp_path, 6), _weights(tmp_path, 9)  # both in stage 1 (steps 5-9)
    codes = "model.layers.1.mlp.up_proj.weight.nf4.quantized_data"
    assert codes in at9 and "model.layers.1.mlp.up_proj.weight" not in at9  # 4-bit codes, not float weights
    assert at9[codes].equal(at6[codes]) and at9["model.layers.0.input_layernorm.weight"].equal(
        at6["model.layers.0.input_layernorm.weight"])  # the trunk is frozen
    lora_b = "model.layers.0.self_attn.q_proj.lora_B"
    assert not at9[lora_b].equal(at6[lora_b]) and at9[lora_b].abs().sum() > 0  # its adapters train
    assert f"optimizer.m.{lora_b}" in at9 and f"optimizer.m.{codes}" not in at9
    assert not at9["model.layers.3.mlp.up_proj.weight"].equal(at6["model.layers.3.mlp.up_proj.weight"])
    ids, live, tok, hf = _live_and_exported(run, tmp_path)
    ours = load_for_inference(tmp_path / "run" / "checkpoint-step-9.json", tokenizer=tok, device="cpu")
    with torch.no_grad():  # dequantized and merged: the function the trained NF4 + adapter model computes
        torch.testing.assert_close(hf(ids).logits, live, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.model(ids), live, rtol=1e-4, atol=1e-4)  # apr generate's model
    # PEFT: the dequantized NF4 trunk (no adapters) plus the dense blocks as the base, the adapters on it
    with_peft = _peft_logits(tmp_path / "run" / "checkpoint-step-9.json", tmp_path / "peft", tok, ids)
    torch.testing.assert_close(with_peft, live, rtol=1e-4, atol=1e-4)
    for f in (tmp_path / "run").glob("checkpoint-step-9.*"):
        f.unlink()
    _inproc(tmp_path, resume="latest", **qlora)  # from step 6: the NF4 codes are loaded, not quantized again
    again = _weights(tmp_path, 9)
    assert set(again) == set(at9) and all(again[k].equal(v) for k, v in at9.items())


def test_kill_9_in_a_prepended_qlora_stage_with_the_users_model_lora_resumes_bitwise(tmp_path):
    stacking = {"stages": [{"blocks": 2, "steps": 4}, {"blocks": 4}], "earlier": "freeze", "trunk_strategy": "qlora",
                "building_mode": "prepend"}
    lora = {"rank": 4, "targets": "all", "dropout": 0.1}  # model.lora on a stacked run: the trunk's adapters
    want_root = tmp_path / "whole"
    make_dataset(want_root)
    cfg = AprConfig.model_validate(json.loads(_cfg(want_root, stacking, lora=lora).read_text()))
    assert cfg.model.stacking.trunk_lora.rank == 4
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=want_root / "cfg.json",
                      options=ApplyOptions(echo=lambda line: None, handle_signals=False))
    assert run.execute().status == "finished"  # uninterrupted, in this process
    root = tmp_path / "killed"
    make_dataset(root)
    path = _cfg(root, stacking, lora=lora)
    _run(path, root, kill_at="step 11/12")  # the newest checkpoint is step 9: inside stage 1, NF4 trunk on top
    _run(path, root, resume=True)
    want, got = _weights(want_root, 12), _weights(root, 12)
    assert "model.layers.3.mlp.up_proj.weight.nf4.quantized_data" in got  # the old stack, on top, in NF4
    assert tuple(got["model.layers.3.mlp.down_proj.lora_A"].shape) == (4, 64)  # model.lora's rank, every projection
    assert set(want) == set(got) and all(got[k].equal(want[k]) for k in want)


def test_progressive_lora_adds_an_adapter_to_the_trunk_at_each_later_grow_resumes_bitwise_across_it_and_exports_merged(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    from apr.checkpoint.export import export_hf

    make_dataset(tmp_path)
    prog = {"stages": [{"blocks": 2, "steps": 3}, {"blocks": 3, "steps": 3}, {"blocks": 4}], "earlier": "freeze",
            "trunk_lora": {"rank": 4, "targets": "all"}, "progressive_lora": {"rank": 2, "alpha": 4}}
    run = _inproc(tmp_path, **prog)
    at6, at9 = _weights(tmp_path, 6), _weights(tmp_path, 9)  # stage 1 (steps 4-6), stage 2 (steps 7-9)
    late = "model.layers.{}.mlp.down_proj.lora_{}_s2"
    assert late.format(0, "A") not in at6  # stage 1: each trunk block has its own adapter only
    for block in (0, 1):  # stage 2's grow: stage 0's blocks get a rank-2 adapter beside their rank-4 one
        assert tuple(at9[late.format(block, "A")].shape) == (2, 64) and at9[late.format(block, "B")].abs().sum() > 0
        assert f"optimizer.m.{late.format(block, 'B')}" in at9
        own = f"model.layers.{block}.mlp.down_proj.lora_B"
        assert not at9[own].equal(at6[own])  # the earlier adapter keeps training
    assert late.format(2, "A") not in at9 and "model.layers.2.mlp.down_proj.lora_A" in at9  # stage 1's: one
    ids, live, tok, hf = _live_and_exported(run, tmp_path)
    with torch.no_grad():  # every adapter folded in, the progressive ones with their own scaling
        torch.testing.assert_close(hf(ids).logits, live, rtol=1e-4, atol=1e-4)
    # PEFT: blocks 0, 1 carry their adapter and the rank-2 progressive one as one rank-6 adapter
    ckpt = tmp_path / "run" / "checkpoint-step-9.json"
    with_peft = _peft_logits(ckpt, tmp_path / "peft", tok, ids)
    torch.testing.assert_close(with_peft, live, rtol=1e-4, atol=1e-4)
    doc = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert doc["layers_to_transform"] == [0, 1, 2] and doc["rank_pattern"]["model.layers.0.mlp.down_proj"] == 6
    assert "model.layers.2.mlp.down_proj" not in doc["rank_pattern"]  # stage 1's block: its one adapter
    torch.testing.assert_close(_peft_logits(ckpt, tmp_path / "peft2", tok, ids, base=tmp_path / "peft" / "base"),
                               live, rtol=1e-4, atol=1e-4)  # --base: its own base folder is accepted
    with pytest.raises(AprError, match="other weights"):  # the merged model is not the adapters' base
        export_hf(ckpt, tmp_path / "peft3", tokenizer=tok, fmt="peft", base=tmp_path / "hf")
    with pytest.raises(AprError, match="no adapters yet"):  # stage 0 (steps 1-3) has no trunk
        export_hf(tmp_path / "run" / "checkpoint-step-3.json", tmp_path / "peft4", tokenizer=tok, fmt="peft")
    for f in (tmp_path / "run").glob("checkpoint-step-9.*"):
        f.unlink()
    _inproc(tmp_path, resume="latest", **prog)  # from step 6: across the grow that adds the adapters
    again = _weights(tmp_path, 9)
    assert set(again) == set(at9) and all(again[k].equal(v) for k, v in at9.items())


def test_the_plan_shows_each_stacks_adapter_params_with_its_progressive_adapters(tmp_path):
    from typer.testing import CliRunner

    from apr.cli.main import app

    make_dataset(tmp_path)
    prog = {"stages": [{"blocks": 2, "steps": 3}, {"blocks": 3, "steps": 3}, {"blocks": 4}], "earlier": "freeze",
            "trunk_lora": {"rank": 4, "targets": "all"}, "progressive_lora": {"rank": 2, "alpha": 4}}
    doc = config_doc(tmp_path, model={"architecture": {"num_hidden_layers": 4}, "stacking": prog},
                     training={"max_steps": 9})
    (tmp_path / "cfg.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["train", "plan", str(tmp_path / "cfg.json")])
    assert r.exit_code == 0, r.stdout
    stage2 = r.stdout.split("stage 2:")[1]  # rank 4 + rank 2 on the 7 projections of 2 blocks (hidden 32)
    assert "stack 0: blocks 0-1 fp32 (adapters)" in stage2 and "6,144 adapter params (2 adapters per projection)" \
        in stage2 and "stack 1: block 2 fp32 (adapters), 36.25 KiB of weights, 2,048 adapter params\n" in stage2


CACHED = {"stages": [{"blocks": 2, "steps": 1}, {"blocks": 4}], "earlier": "freeze", "freeze_embedding": True}


def test_cached_trunk_activations_give_the_uncached_weights_bitwise_resume_with_the_cache_and_survive_a_full_disk(
        tmp_path, monkeypatch):
    import errno

    import numpy as np

    runs = {}
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for name, cache in (("uncached", False), ("cached", True), ("full_disk", True)):
        root = tmp_path / name
        make_dataset(root, train_rows=20)  # 5 steps an epoch: stage 1 (steps 2-9) reads rows again
        with monkeypatch.context() as m:
            if name == "full_disk":
                m.setattr(np, "save", no_space)
            runs[name] = _inproc(root, **CACHED, cache_activations=cache)
    cache = runs["cached"].engine.trunk_cache
    assert cache.hits > 0 and cache.misses > 0 and cache.enabled  # rows seen again came from the disk
    assert not runs["full_disk"].engine.trunk_cache.enabled and not any(runs["full_disk"].engine.trunk_cache.files)
    want = _weights(tmp_path / "uncached", 9)
    assert "model.embed_tokens.weight" in want and "optimizer.m.model.embed_tokens.weight" not in want  # frozen
    for name in ("cached", "full_disk"):
        got = _weights(tmp_path / name, 9)
        assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want), name
    root = tmp_path / "cached"
    for f in (root / "run").glob("checkpoint-step-9.*"):
        f.unlink()
    resumed = _inproc(root, resume="latest", **CACHED, cache_activations=True)  # from step 6: the same trunk
    assert resumed.engine.trunk_cache.folder == cache.folder and resumed.engine.trunk_cache.hits > 0
    got = _weights(root, 9)
    assert all(got[k].equal(want[k]) for k in want)


def test_adapter_patterns_give_each_stacks_trunk_adapters_their_own_rank_and_alpha(tmp_path, monkeypatch):
    """StackWise's progressive and per-stack QLoRA settings: ``adapter_pattern`` doubles the rank per
    stage, ``stages[1].adapters`` sets its own alpha; each trunk block carries its stage's adapters,
    the plan counts them, exports fold each with its own scaling, and a resume across the grow is bitwise."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from apr.model import spec
    from apr.steps.stacking import block_adapters

    make_dataset(tmp_path)
    pattern = {"stages": [{"blocks": 2, "steps": 3}, {"blocks": 3, "steps": 3, "adapters": {"alpha": 32}},
                          {"blocks": 4}],
               "earlier": "freeze", "trunk_lora": {"rank": 4, "targets": "all"},
               "adapter_pattern": {"rank": "increasing"}}
    run = _inproc(tmp_path, **pattern)
    at9 = _weights(tmp_path, 9)
    a = "model.layers.{}.mlp.down_proj.lora_A"
    assert [tuple(at9[a.format(b)].shape)[0] for b in (0, 1, 2)] == [4, 4, 8]  # stage 0: 4; stage 1: 4 x 2
    config = run.config  # the last stage's: what the plan counted for it
    assert [block_adapters(config, b).scaling for b in (0, 2)] == [16 / 4, 32 / 8]
    trained = sum(p.numel() for p in run.engine.model.parameters() if p.requires_grad)
    assert trained == spec.trainable_param_count(config)
    ids, live, tok, hf = _live_and_exported(run, tmp_path)
    with torch.no_grad():  # each block's adapters folded in with its own scaling
        torch.testing.assert_close(hf(ids).logits, live, rtol=1e-4, atol=1e-4)
    ckpt = tmp_path / "run" / "checkpoint-step-9.json"
    torch.testing.assert_close(_peft_logits(ckpt, tmp_path / "peft", tok, ids), live, rtol=1e-4, atol=1e-4)
    doc = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert doc["rank_pattern"]["model.layers.2.mlp.down_proj"] == 8 and doc["r"] == 4
    assert "model.layers.0.mlp.down_proj" not in doc["rank_pattern"]  # stage 0's blocks: the trunk's own
    for f in (tmp_path / "run").glob("checkpoint-step-9.*"):
        f.unlink()
    _inproc(tmp_path, resume="latest", **pattern)  # from step 6: across the grow that gives block 2 its adapters
    again = _weights(tmp_path, 9)
    assert set(again) == set(at9) and all(again[k].equal(v) for k, v in at9.items())


def _live_and_exported(run, root: Path):
    """Token ids, the live model's logits on them, a tokenizer, and the HF export of step 9 loaded."""
    from transformers import AutoModelForCausalLM

    from apr.checkpoint.export import export_hf
    from apr.data.standin import write_tokenizer

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        live = run.engine.model.eval()(ids)
    tok = write_tokenizer(root / "tokenizer.json", VOCAB)
    export_hf(root / "run" / "checkpoint-step-9.json", root / "hf", tokenizer=tok)
    return ids, live, tok, AutoModelForCausalLM.from_pretrained(str(root / "hf")).eval()
