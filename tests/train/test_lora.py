"""LoRA (model.lora): only adapters train, in both engines alike; the frozen base has no gradients
or moments (the buffer plan and the plan's memory table say so); checkpoints hold adapters plus the
base's SHA-256; resume is bitwise; export merges (hf) or writes a PEFT folder that peft loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from run_helpers import config_doc, make_dataset
from safetensors.torch import load_file

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.memory import buffers
from apr.model import spec
from apr.plan.build import resolve_config
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from apr.train.run import ApplyOptions, prepare_run
from tests.train.tiny import batches, make_config

LORA = {"rank": 4, "alpha": 8.0, "targets": "all"}


def _run(root, *, resume=None, **sections):
    cfg = AprConfig.model_validate(config_doc(root, **sections))
    lines: list[str] = []
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(resume=resume, echo=lines.append))
    return run.execute(), run, lines


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The pattern dataset and a base model pretrained on it for 16 steps (root/base)."""
    root = tmp_path_factory.mktemp("lora")
    make_dataset(root)
    result, _, _ = _run(root, training={"max_steps": 16, "epochs": 1, "output_dir": "base/", "eval_interval": 0})
    assert result.final_step == 16
    return root


def lora_sections(root, out: str, lora=None, **training) -> dict:
    return {"model": {"init_from": str(root / "base"), "lora": lora or LORA},
            "training": {"output_dir": out, **training}}


# ------------------------------------------------------------------------------ engine and plan


def test_trainable_parameters_and_optimizer_memory_follow_the_formula():
    config = make_config(model={"init_from": "unused", "lora": {"rank": 3, "targets": ["q_proj", "down_proj"]}})
    arch = config.model.architecture  # hidden 32, 4 heads of 8, intermediate 64, 3 layers
    r, h, inter = 3, arch.hidden_size, arch.intermediate_size
    formula = arch.num_hidden_layers * (r * (h + arch.num_attention_heads * arch.head_dim) + r * (inter + h))
    assert spec.trainable_param_count(config) == formula == 3 * (3 * 64 + 3 * 96)
    plan = buffers.buffer_plan(config)
    by = {}
    for b in plan:
        by[b.component] = by.get(b.component, 0) + b.nbytes
    assert by["adamw_m"] == by["adamw_v"] == by["adapters"] == 4 * formula
    assert by["frozen_weights"] == 4 * spec.param_count(arch) and "weights" not in by
    full = buffers.buffer_plan(make_config())
    full_by = {}
    for b in full:
        full_by[b.component] = full_by.get(b.component, 0) + b.nbytes
    assert full_by["adamw_m"] == 4 * spec.param_count(arch)  # the saving: moments of the base, gone
    assert by["gradients"] < full_by["gradients"] / 10


def _lora_engine(tmp_path, lora=None, **training):
    from apr.checkpoint.manager import CheckpointManager, TrainState

    base_cfg = make_config()
    if not (tmp_path / "base").exists():
        base = build_engine(plan_of(base_cfg))
        CheckpointManager(tmp_path / "base", base_cfg).save(
            TrainState(step=1, tensors=base.train_state_tensors(), meta={}))
    cfg = make_config(model={"init_from": str(tmp_path / "base"), "lora": lora or LORA}, training=training)
    return build_engine(plan_of(cfg))


@pytest.mark.parametrize(("training", "dropout"), [
    ({"engine": "interleaved", "execution": {"activations": "recompute", "gradients": "workspace"}}, 0.0),
    ({"engine": "interleaved", "execution": {"activations": "keep"}}, 0.0),
    ({"engine": "interleaved", "execution": {"activations": "selective"}, "gradient_accumulation": 2}, 0.0),
    # dropout: a recomputed block replays its forward's masks (with a norm-only walk first, twice)
    ({"engine": "interleaved", "execution": {"activations": "recompute", "gradients": "workspace"}}, 0.2),
    ({"engine": "interleaved", "execution": {"activations": "selective", "gradients": "workspace"}}, 0.2),
])
def test_interleaved_lora_equals_the_standard_engine(tmp_path, training, dropout):
    accum = training.get("gradient_accumulation", 1)
    data = batches(make_config(), 3 * accum, seed=4)
    states = {}
    lora = {**LORA, "dropout": dropout}
    for name, tr in (("interleaved", training), ("standard", {"engine": "standard",
                                                              "gradient_accumulation": accum})):
        engine = _lora_engine(tmp_path, lora=lora, **tr)
        torch.manual_seed(0)  # dropout draws from the global RNG, like any torch dropout
        norms = [float(engine.train_step(data[k * accum:(k + 1) * accum], lr=1e-2).grad_norm) for k in range(3)]
        states[name] = (norms, {k: v.clone() for k, v in engine.train_state_tensors().items()}, engine)
    (ni, si, ei), (ns, ss, es) = states["interleaved"], states["standard"]
    assert ni == pytest.approx(ns, rel=1e-6)
    assert si.keys() == ss.keys() and all(".lora_" in k for k in si)
    for k in ss:
        torch.testing.assert_close(si[k], ss[k], atol=1e-7, rtol=1e-6)
    assert max(float(v.abs().max()) for k, v in si.items() if k.endswith("lora_B")) > 0  # B moved off zero
    for engine in (ei, es):  # the frozen base has no gradients and did not move
        frozen = [(n, p) for n, p in engine.model.named_parameters() if ".lora_" not in n]
        assert frozen and all(not p.requires_grad and p.grad is None for _, p in frozen)
    base = _lora_engine(tmp_path, engine="standard").model.state_dict()
    for n, p in ei.model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p.detach().cpu(), base[n]), n


def test_plan_memory_table_shows_the_saving(root):
    from apr.plan.build import build_plan
    from apr.plan.examples import to_yaml

    rows = {}
    for name, sections in (("full", {}), ("lora", lora_sections(root, "p/"))):
        path = root / f"plan-{name}.yaml"
        path.write_text(to_yaml(config_doc(root, **sections)))
        plan = build_plan(path)
        assert not plan.errors, plan.errors
        rows[name] = {r.component: r.bytes for r in plan.memory}
        rows[name]["trainable"] = plan.facts["model"]["trainable_params"]
        rows[name]["params"] = plan.facts["model"]["params"]
    assert rows["lora"]["trainable"] == spec.trainable_param_count(
        AprConfig.model_validate(config_doc(root, **lora_sections(root, "p/")))) < rows["lora"]["params"] / 4
    assert rows["lora"]["adamw_m"] == rows["lora"]["adamw_v"] == 4 * rows["lora"]["trainable"]
    assert rows["full"]["adamw_m"] == 4 * rows["full"]["params"]
    assert rows["lora"]["frozen_weights"] == rows["full"]["weights"] and "weights" not in rows["lora"]


# -------------------------------------------------------------------------------- runs and files


@pytest.mark.slow
def test_lora_run_lowers_the_loss_and_checkpoints_hold_adapters_and_the_base_hash(root):
    lora = {"rank": 8, "alpha": 32.0, "targets": "all"}
    sections = lora_sections(root, "lora1/", lora=lora, max_steps=48, epochs=4, eval_interval=24, save_interval=24)
    sections["optimizer"] = {"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 0.0}
    result, run, _ = _run(root, **sections)
    assert result.final_step == 48 and result.first_val_loss is not None
    # starts exactly at the base's loss (B = 0) and falls; slowly on this task, whose counting
    # pattern lives mostly in the (frozen) embedding: full fine-tuning gets further
    assert result.val_loss < result.first_val_loss - 0.05
    tensors = load_file(str(root / "lora1" / "checkpoint-step-48.safetensors"))
    assert tensors and all(".lora_" in k for k in tensors)
    side = json.loads((root / "lora1" / "checkpoint-step-48.json").read_text())
    base_side = json.loads((root / "base" / "checkpoint-step-16.json").read_text())  # init_from: the newest
    assert side["engine"]["base"]["sha256"] == base_side["weights_sha256"]


def test_lora_resume_is_bitwise(root, tmp_path):
    full, _, _ = _run(root, **lora_sections(root, "lora2/", max_steps=12, save_interval=4))
    final = load_file(str(root / "lora2" / "checkpoint-step-12.safetensors"))
    (tmp_path / "run").mkdir()
    for suffix in ("json", "safetensors"):
        shutil.copy(root / "lora2" / f"checkpoint-step-4.{suffix}", tmp_path / "run" / f"checkpoint-step-4.{suffix}")
    resumed, run, _ = _run(root, resume="latest", **lora_sections(root, str(tmp_path / "run"), max_steps=12,
                                                                   save_interval=4))
    assert run.start_step == 4 and resumed.final_step == 12
    again = load_file(str(tmp_path / "run" / "checkpoint-step-12.safetensors"))
    assert set(again) == set(final) and all(again[k].equal(final[k]) for k in final)


def _adapted_logits(root, ckpt_dir, ids):
    """apr's adapted model, adapters from the newest checkpoint of ``ckpt_dir``."""
    from apr.checkpoint.manager import load_latest

    state = load_latest(ckpt_dir)
    cfg = AprConfig.model_validate(state.info.config)
    standard = cfg.model_copy(update={"training": cfg.training.model_copy(update={"engine": "standard"})})
    engine = build_engine(plan_of(standard))
    engine.load_train_state_tensors(state.tensors)
    with torch.no_grad():
        return engine.model(ids)


def test_export_merges_and_peft_loads_the_adapters_with_the_same_logits(root, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from apr.checkpoint.export import export_hf

    _run(root, **lora_sections(root, "lora3/", max_steps=8, save_interval=8))
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = _adapted_logits(root, root / "lora3", ids)
    tok = root / "tok.json"
    from apr.plan.examples import write_tokenizer

    write_tokenizer(tok, 61)
    export_hf(root / "lora3", tmp_path / "merged", tokenizer=tok)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits.float()
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    # the base alone, as an HF folder, then the adapters on it with peft
    export_hf(root / "base", tmp_path / "base-hf", tokenizer=tok)
    export_hf(root / "lora3", tmp_path / "adapter", fmt="peft")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors", "base"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits.float()
    torch.testing.assert_close(adapted, ours, atol=1e-5, rtol=0)
    with torch.no_grad(), model.disable_adapter():  # the adapters do change the output
        assert (model(input_ids=ids).logits.float() - ours).abs().max() > 1e-3


def test_export_refuses_a_changed_base(root, tmp_path):
    from apr.checkpoint.export import export_hf

    _run(root, **lora_sections(root, "lora4/", max_steps=4, save_interval=4))
    doc = json.loads((root / "lora4" / "checkpoint-step-4.json").read_text())
    # another base: a different pretraining run
    _run(root, training={"max_steps": 2, "epochs": 1, "output_dir": str(tmp_path / "other"), "eval_interval": 0,
                         "seed": 9})
    cfg = AprConfig.model_validate(doc["config"])
    with pytest.raises(AprError, match="not the base the adapters"):
        from apr.checkpoint.export import _checked_base
        from apr.checkpoint.manager import read_info

        info = read_info(root / "lora4" / "checkpoint-step-4.json")
        other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": str(tmp_path / "other")})})
        _checked_base(info, other)
    with pytest.raises(AprError, match="not a LoRA checkpoint"):
        export_hf(root / "base", tmp_path / "x", fmt="peft")


# ------------------------------------------------------------------------------------ bad input


def _validate(tmp_path, lora: dict, init_from: str | None = "base/"):
    from tests.plan.plan_helpers import apr_cli

    doc = config_doc(tmp_path, model={"lora": lora, **({"init_from": init_from} if init_from else {})})
    from apr.plan.examples import to_yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(doc))
    r = apr_cli("train", "validate", str(path), cwd=tmp_path)
    assert "Traceback" not in r.stderr
    return r.returncode, r.stdout + r.stderr, path.read_text().splitlines()


def test_rank_larger_than_a_targeted_layer_fails_validate_at_its_line(tmp_path):
    rc, out, lines = _validate(tmp_path, {"rank": 20, "targets": ["k_proj"]})  # k_proj: 32 -> 16
    assert rc == 1 and "C-LORA-001" in out and "rank 20 is larger than 16" in out and "k_proj" in out
    assert f"cfg.yaml:{next(i for i, x in enumerate(lines, 1) if 'rank:' in x)}" in out


def test_targets_matching_nothing_and_lora_without_a_base_are_refused(tmp_path):
    rc, out, _ = _validate(tmp_path, {"rank": 4, "targets": ["qkv_proj"]})
    assert rc == 1 and "qkv_proj" in out and "match no layer" in out and "model.lora.targets" in out
    rc, out, _ = _validate(tmp_path, {"rank": 4}, init_from=None)
    assert rc == 1 and "C-LORA-002" in out and "model.init_from" in out


# --------------------------------------------------------------------- dual LoRA (StackWise)


def test_a_second_stage_trains_new_adapters_over_the_first_stage_merged(root):
    """Stage 2's init_from is stage 1's LoRA run: its frozen trunk is base + stage-1 adapters, and it
    starts (B = 0) exactly at stage 1's adapted model."""
    _run(root, **lora_sections(root, "stage1/", max_steps=4, save_interval=4))
    stage2 = AprConfig.model_validate(config_doc(root, model={
        "init_from": str(root / "stage1"), "lora": {"rank": 2, "alpha": 4.0, "targets": "mlp"}},
        training={"output_dir": "stage2/", "engine": "standard"}))
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        start = build_engine(plan_of(stage2)).model(ids)
    torch.testing.assert_close(start, _adapted_logits(root, root / "stage1", ids), atol=1e-5, rtol=0)
    result, run, _ = _run(root, model=stage2.model.model_dump(mode="json"),
                          training={"output_dir": "stage2/", "max_steps": 4, "save_interval": 4})
    assert result.final_step == 4
    saved = load_file(str(root / "stage2" / "checkpoint-step-4.safetensors"))
    assert all(".mlp." in k and ".lora_" in k for k in saved)  # the new stage's adapters only
    side = json.loads((root / "stage2" / "checkpoint-step-4.json").read_text())
    stage1 = json.loads((root / "stage1" / "checkpoint-step-4.json").read_text())
    assert side["engine"]["base"]["sha256"] == stage1["weights_sha256"]


def test_a_bf16_trunk_halves_the_frozen_projections_and_both_engines_agree(tmp_path):
    lora = {**LORA, "trunk_dtype": "bf16"}
    cfg = make_config(model={"init_from": "x", "lora": lora}, training={"mixed_precision": "bf16"})
    arch = cfg.model.architecture
    proj = arch.num_hidden_layers * sum(p.numel for p in spec.block_param_specs(arch, 0) if p.decay)
    frozen = sum(b.nbytes for b in buffers.buffer_plan(cfg) if b.component == "frozen_weights")
    assert frozen == 4 * (spec.param_count(arch) - proj) + 2 * proj
    data = batches(make_config(), 2, seed=2)
    weights = {}
    for kind in ("interleaved", "standard"):
        engine = _lora_engine(tmp_path, lora=lora, engine=kind, mixed_precision="bf16")
        q = engine.model.model.layers[0].self_attn.q_proj
        assert q.weight.dtype == torch.bfloat16 and q.lora_A.dtype == torch.float32
        for d in data:
            assert torch.isfinite(engine.train_step([d], lr=1e-2).loss)
        weights[kind] = {k: v.clone() for k, v in engine.train_state_tensors().items()}
    for k in weights["standard"]:
        torch.testing.assert_close(weights["interleaved"][k], weights["standard"][k], atol=1e-6, rtol=1e-5)


def test_a_bf16_trunk_is_read_in_float32_outside_autocast():
    """Evaluation and samples compute in float32 without autocast: a bf16 trunk is widened (exactly),
    so they see the weights training multiplies under bf16 autocast."""
    from apr.model.lora import LoRALinear

    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen).bfloat16(), requires_grad=False)
    layer = LoRALinear(weight, rank=2, scaling=2.0, dropout=0.0)
    with torch.no_grad():
        layer.lora_A.normal_(generator=gen)
        layer.lora_B.normal_(generator=gen)
    x = torch.randn(3, 4, generator=gen)
    want = x @ weight.float().T + (x @ layer.lora_A.T) @ layer.lora_B.T * 2.0
    torch.testing.assert_close(layer(x), want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # training: the bf16 matmul, unchanged
        assert layer(x).dtype == torch.bfloat16


def test_merging_onto_a_bf16_trunk_uses_the_rounded_weights():
    from apr.config.schema import LoraConfig
    from apr.model.lora import merge

    cfg = make_config()
    arch = cfg.model.architecture
    lora = LoraConfig(rank=2, alpha=4.0, targets=["q_proj"], trunk_dtype="bf16")
    gen = torch.Generator().manual_seed(0)
    base = {p.name: torch.randn(p.shape, generator=gen) for p in spec.param_specs(arch)}
    adapters = {p.name: torch.randn(p.shape, generator=gen) for i in range(arch.num_hidden_layers)
                for p in spec.lora_block_specs(arch, lora, i)}
    out = merge(base, adapters, arch, lora)
    q, k = "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"
    want = base[f"{q}.weight"].bfloat16().float() + 2.0 * adapters[f"{q}.lora_B"] @ adapters[f"{q}.lora_A"]
    assert torch.equal(out[f"{q}.weight"], want)
    assert torch.equal(out[f"{k}.weight"], base[f"{k}.weight"].bfloat16().float())  # untargeted, rounded
    assert torch.equal(out["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not a projection


def test_generate_and_eval_load_a_lora_run_merged_into_its_base(root):
    from apr.generate.load import load_for_inference

    _run(root, **lora_sections(root, "lora5/", max_steps=4, save_interval=4))
    loaded = load_for_inference(root / "lora5", need_tokenizer=False)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = loaded.model(ids)
    torch.testing.assert_close(got, _adapted_logits(root, root / "lora5", ids), atol=1e-5, rtol=0)
