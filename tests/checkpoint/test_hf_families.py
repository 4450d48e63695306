"""model.init_from for each family apr imports (LLaMA with each RoPE scaling, Llama-3.2-style tied
embeddings, TinyLlama, Qwen2 with its q/k/v biases, Mistral with its sliding window), from a tiny
random model transformers builds here: the architecture comes from the folder's config.json, the
step-0 logits and loss equal transformers', both engines train it alike, export writes the same
family back (from_pretrained gives the same logits) and greedy generation equals transformers'.
Bad folders exit 1 naming the file and what was found, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from apr.checkpoint.hf_import import InitFromError, inspect_source
from apr.config.schema import AprConfig
from apr.plan.examples import write_tokenizer
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from tests.plan.plan_helpers import apr_cli
from tests.train.tiny import TINY, batches

transformers = pytest.importorskip("transformers")

SHAPES = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=53, max_position_embeddings=32, rms_norm_eps=1e-6)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
# name -> (transformers config class, its keyword arguments)
FAMILIES = {
    "llama3.2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("LlamaConfig", {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "dynamic",
                                                          "factor": 2.0}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 8}}),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "tinyllama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1000000.0,
                                                                                 "rope_type": "default"}}),
    "mistral": ("MistralConfig", {"sliding_window": 5}),  # seq_len 12: the window masks
}


def hf_model(folder: Path, family: str, seed: int = 3, shard: str | None = None, **shapes):
    """A random tiny model of ``family`` saved with save_pretrained (safetensors), and the model.
    Norms and biases are randomised so that they matter in the comparison."""
    torch.manual_seed(seed)
    cls, over = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**SHAPES, **over, **shapes})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return model


def config_for(folder: Path, architecture: dict | None = None, **training) -> AprConfig:
    """TINY without its architecture: it comes from the folder (``architecture``: keys set anyway)."""
    doc = {**TINY, "model": {"init_from": str(folder), **({"architecture": architecture} if architecture else {})}}
    doc["training"] = {**TINY["training"], **training}
    return AprConfig.model_validate(doc)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step0_logits_and_loss_equal_transformers_and_both_engines_train_it_alike(tmp_path, family):
    shard = "12KB" if family in ("qwen2", "llama3.2", "mistral") else None  # a sharded folder for three of them
    hf = hf_model(tmp_path / "hf", family, shard=shard)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == (shard is not None)
    data = batches(config_for(tmp_path / "hf"), 1, seed=5)
    ids, targets = data[0][:, :-1], data[0][:, 1:]
    theirs = hf_logits(hf, ids)
    want_loss = F.cross_entropy(theirs.reshape(-1, theirs.shape[-1]), targets.reshape(-1)).item()
    after = {}
    for kind in ("standard", "interleaved"):
        config = config_for(tmp_path / "hf", engine=kind)
        engine = build_engine(plan_of(config))
        with torch.no_grad():
            ours = engine.model(ids)
        assert theirs.abs().max() > 0.1  # not a degenerate model
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        loss = float(engine.train_step(data, lr=1e-2).loss)
        assert loss == pytest.approx(want_loss, abs=1e-4), kind
        after[kind] = {k: v.clone() for k, v in engine.train_state_tensors().items() if "optimizer" not in k}
    for k in after["standard"]:
        torch.testing.assert_close(after["interleaved"][k], after["standard"][k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["standard", "interleaved"])
def test_lora_over_a_qwen2_base_starts_at_transformers_loss_biases_included(tmp_path, engine):
    hf = hf_model(tmp_path / "hf", "qwen2")
    doc = {**TINY, "model": {"init_from": str(tmp_path / "hf"), "lora": {"rank": 4, "targets": "all"}},
           "training": {**TINY["training"], "engine": engine}}
    config = AprConfig.model_validate(doc)
    data = batches(config, 1, seed=5)
    theirs = hf_logits(hf, data[0][:, :-1])
    want = F.cross_entropy(theirs.reshape(-1, theirs.shape[-1]), data[0][:, 1:].reshape(-1)).item()
    assert float(build_engine(plan_of(config)).train_step(data, lr=1e-2).loss) == pytest.approx(want, abs=1e-4)


def test_the_architecture_is_read_from_the_folder_and_a_key_set_anyway_must_agree(tmp_path):
    hf_model(tmp_path / "hf", "qwen2")
    arch = config_for(tmp_path / "hf").model.architecture
    assert (arch.family, arch.tie_word_embeddings, arch.rope_theta, arch.rms_norm_eps) == ("qwen2", True, 1e6, 1e-6)
    assert arch.hidden_size == 32 and arch.kv_heads == 2
    hf_model(tmp_path / "l3", "llama3.2")
    arch = config_for(tmp_path / "l3").model.architecture
    assert arch.rope_scaling.rope_type == "llama3" and arch.rope_scaling.factor == 8.0
    # a key that agrees, or one that changes nothing the weights fix, is accepted
    arch = config_for(tmp_path / "hf", {"max_position_embeddings": 16, "hidden_size": 32}).model.architecture
    assert not inspect_source(str(tmp_path / "hf"), arch).findings
    # one that contradicts the folder is refused at its key
    src = inspect_source(str(tmp_path / "hf"), config_for(tmp_path / "hf", {"family": "llama"}).model.architecture)
    found = [(f.code, f.path) for f in src.findings]
    assert ("init_from.architecture_mismatch", "model.architecture.family") in found


def plan_config(tmp_path: Path, init_from: Path, architecture: dict | None = None) -> Path:
    from apr.data.testing import make_shards

    make_shards(tmp_path / "data", n_rows=64, seq_len=12, vocab_size=SHAPES["vocab_size"])
    model = {"init_from": str(init_from), **({"architecture": architecture} if architecture else {})}
    doc = {"model": model, "data": {"train": str(tmp_path / "data" / "train"), "batch_size": 2, "seq_len": 12},
           "training": {"device": "cpu", "output_dir": str(tmp_path / "out"), "max_steps": 2}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def plan_json(tmp_path: Path, cfg: Path) -> tuple[int, dict, str]:
    r = apr_cli("train", "plan", str(cfg), "--json", cwd=tmp_path)
    assert "Traceback" not in r.stderr
    return r.returncode, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}, r.stdout + r.stderr


def test_the_plan_shows_what_it_took_from_the_folder_and_counts_biases_and_tied_embeddings(tmp_path):
    hf = hf_model(tmp_path / "hf", "qwen2")
    rc, doc, _ = plan_json(tmp_path, plan_config(tmp_path, tmp_path / "hf", {"rope_theta": 1e6}))
    assert rc == 0, doc.get("findings")
    facts = doc["facts"]
    taken = facts["init_from"]["architecture_from_folder"]
    assert taken["file"].endswith("hf/config.json")
    assert taken["keys"]["family"] == "qwen2" and taken["keys"]["tie_word_embeddings"] is True
    assert "rope_theta" not in taken["keys"]  # the config set it
    info = [f for f in doc["findings"] if f["code"] == "init_from.architecture_from_folder"]
    assert info and info[0]["path"] == "model.architecture" and "family qwen2" in info[0]["message"]
    n = sum(p.numel() for p in hf.parameters())  # transformers counts the tied matrix once, biases in
    assert facts["model"]["params"] == n == facts["init_from"]["params"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3.2", "tinyllama", "llama-yarn"])
def test_export_writes_the_same_family_back_with_equal_logits(tmp_path, family, monkeypatch):
    from apr.checkpoint.export import export_hf
    from apr.checkpoint.manager import CheckpointManager, TrainState

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = hf_model(tmp_path / "hf", family)
    write_tokenizer(tmp_path / "hf" / "tokenizer.json", SHAPES["vocab_size"])
    config = config_for(tmp_path / "hf", engine="standard")
    engine = build_engine(plan_of(config))
    data = batches(config, 1, seed=5)
    engine.train_step(data, lr=1e-2)
    CheckpointManager(tmp_path / "run", config).save(TrainState(step=1, tensors=engine.train_state_tensors(), meta={}))
    export_hf(tmp_path / "run", tmp_path / "export")
    doc = json.loads((tmp_path / "export" / "config.json").read_text())
    assert doc["model_type"] == hf.config.model_type and doc["architectures"] == [type(hf).__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(back) is type(hf)
    ids = data[0][:, :-1]
    with torch.no_grad():
        ours = engine.model(ids)
    torch.testing.assert_close(hf_logits(back, ids), ours, atol=1e-5, rtol=0)
    assert (hf_logits(back, ids) - hf_logits(hf, ids)).abs().max() > 1e-4  # the trained weights, not the source's


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3.2", "llama-yarn"])
def test_greedy_generation_equals_transformers_token_for_token(tmp_path, family):
    from apr.generate.generate import GenerateOptions, generate
    from apr.generate.load import load_for_inference
    from apr.generate.sampling import Sampling

    hf = hf_model(tmp_path / "hf", family)
    write_tokenizer(tmp_path / "hf" / "tokenizer.json", SHAPES["vocab_size"])
    loaded = load_for_inference(tmp_path / "hf")
    for text in ("t3 t17 t4", "t9 t9 t1 t40 t2 t8"):
        ids = loaded.tokenizer.encode(text).ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = out[0, len(ids):].tolist()
        got = generate(loaded, [text], GenerateOptions(max_new_tokens=16, sampling=Sampling(temperature=0),
                                                       stop_at_eos=False)).generations[0]
        assert got.token_ids == want, text
        assert len(want) == 16  # past the sliding window of the Mistral (5 positions)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3.2"])
def test_a_lora_run_on_each_family_exports_peft_adapters_over_the_same_family(tmp_path, family, monkeypatch):
    """apr train apply with model.lora over the folder, then apr export --format peft: PEFT loads the
    adapters onto the exported base (of the folder's class) with apr's logits."""
    from apr.checkpoint.export import export_hf
    from apr.checkpoint.manager import load_latest
    from apr.config.loader import config_hash
    from apr.plan.build import resolve_config
    from apr.train.run import ApplyOptions, prepare_run
    from tests.train.run_helpers import VOCAB, config_doc, make_dataset

    peft = pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = hf_model(tmp_path / "hf", family, vocab_size=VOCAB)
    make_dataset(tmp_path, train_rows=16, val_rows=4)
    doc = config_doc(tmp_path, training={"max_steps": 2, "epochs": 1, "eval_interval": 0, "save_interval": 2,
                                         "output_dir": "lora/"})
    doc["model"] = {"init_from": str(tmp_path / "hf"), "lora": {"rank": 4, "alpha": 8.0, "targets": "all"}}
    cfg = AprConfig.model_validate(doc)
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                      options=ApplyOptions(echo=lambda line: None))
    assert run.execute().final_step == 2
    result = export_hf(tmp_path / "lora", tmp_path / "peft", fmt="peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(result.base))
    assert type(base) is type(hf)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    state = load_latest(tmp_path / "lora")
    engine = build_engine(plan_of(cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"engine": "standard"})})))
    engine.load_train_state_tensors(state.tensors)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = engine.model(ids)
        torch.testing.assert_close(model(input_ids=ids).logits.float(), ours, atol=1e-5, rtol=0)
        with model.disable_adapter():  # the adapters trained: they change the output
            assert (model(input_ids=ids).logits.float() - ours).abs().max() > 1e-4


# ------------------------------------------------------------------------------------- bad folders


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("case", ["unknown_architecture", "shapes_disagree", "rope_type", "missing_shard"])
def test_a_bad_folder_exits_1_naming_the_file_and_what_was_found(tmp_path, case):
    folder = tmp_path / "hf"
    hf_model(folder, "qwen2", shard="12KB" if case == "missing_shard" else None)
    if case == "unknown_architecture":
        edit_config(folder, model_type="gemma2", architectures=["Gemma2ForCausalLM"])
        named = ["config.json", "'gemma2'", "Gemma2ForCausalLM"]
    elif case == "shapes_disagree":
        edit_config(folder, intermediate_size=96)
        named = ["model.safetensors", "model.layers.0.mlp.gate_proj.weight", "[64, 32]"]
    elif case == "rope_type":
        edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0]})
        named = ["config.json", "rope_parameters.rope_type", "'longrope'"]
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shard = sorted(set(index["weight_map"].values()))[1]
        (folder / shard).unlink()
        named = [shard]
    rc, doc, text = plan_json(tmp_path, plan_config(tmp_path, folder))
    assert rc == 1, text
    for word in named:
        assert word in text, (word, text)
    assert not (tmp_path / "out").exists()
    r = apr_cli("train", "apply", str(tmp_path / "train.yaml"), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    with pytest.raises((InitFromError, ValueError)):
        build_engine(plan_of(config_for(folder, SHAPES)))


# --------------------------------------------------------- QLoRA: an NF4 base of any family (item 3)

QLORA = {"rank": 4, "alpha": 8.0, "targets": "all", "trunk_dtype": "nf4"}


def through_nf4(hf):
    """A copy of the transformers model whose block projections are their NF4 quantization,
    dequantized: what a QLoRA run's frozen base multiplies by."""
    import copy

    from apr.model.lora import as_stored

    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith("_proj.weight"):
                p.copy_(as_stored(p.detach().float(), "nf4"))
    return model


@pytest.mark.parametrize("family", ["qwen2", "mistral", "llama3.2", "tinyllama"])
def test_qlora_over_each_family_starts_at_transformers_over_the_nf4_base_in_both_engines(tmp_path, family):
    """model.lora.trunk_dtype nf4 over a folder of each family (qwen2 sharded): the projections are
    stored in NF4 (the plan's frozen bytes are the tensors'), the step-0 logits and loss are
    transformers' over the dequantized base, and both engines train the adapters alike."""
    from apr.memory.buffers import frozen_buffers

    hf = hf_model(tmp_path / "hf", family, shard="12KB" if family == "qwen2" else None)
    quantized = through_nf4(hf)
    after = {}
    for kind in ("standard", "interleaved"):
        doc = {**TINY, "model": {"init_from": str(tmp_path / "hf"), "lora": QLORA},
               "training": {**TINY["training"], "engine": kind}}
        config = AprConfig.model_validate(doc)
        data = batches(config, 1, seed=5)
        ids, targets = data[0][:, :-1], data[0][:, 1:]
        theirs = hf_logits(quantized, ids)
        assert (theirs - hf_logits(hf, ids)).abs().max() > 1e-3  # NF4 moved the weights
        engine = build_engine(plan_of(config))
        stored = [m.weight for n, m in engine.model.named_modules() if n.endswith("_proj")]
        assert len(stored) == 7 * SHAPES["num_hidden_layers"] and all(type(w).__name__ == "NF4Tensor" for w in stored)
        measured = sum(getattr(w, part).nbytes for w in stored for part in
                       ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"))
        planned = {b.name: b for b in frozen_buffers(config)}["frozen_projections"]
        assert (planned.dtype, planned.shape[0]) == ("uint8", measured)
        assert measured < sum(w.numel() for w in stored) * 0.6  # about half a byte per weight
        with torch.no_grad():
            torch.testing.assert_close(engine.model(ids), theirs, atol=1e-4, rtol=0)
        want = F.cross_entropy(theirs.reshape(-1, theirs.shape[-1]), targets.reshape(-1)).item()
        assert float(engine.train_step(data, lr=1e-2).loss) == pytest.approx(want, abs=1e-4)
        engine.train_step(data, lr=1e-2)
        after[kind] = {k: v.clone() for k, v in engine.train_state_tensors().items() if "optimizer" not in k}
    assert after["standard"] and all(".lora_" in k for k in after["standard"])  # adapters only
    for k in after["standard"]:
        torch.testing.assert_close(after["interleaved"][k], after["standard"][k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "llama3.2"])
def test_a_qlora_run_resumes_bitwise_and_exports_merged_and_peft_with_its_logits(tmp_path, family, monkeypatch):
    """apr train apply with an NF4 base: a run resumed from its step-2 checkpoint ends bitwise equal
    to the straight run (the base is quantized again from the folder, to the same codes); export
    --format hf merges onto the dequantized base (from_pretrained gives the run's logits, in the
    folder's class) and --format peft writes that base beside the adapters (PEFT gives them too)."""
    import shutil

    from safetensors.torch import load_file

    from apr.checkpoint.export import export_hf
    from apr.checkpoint.manager import load_latest
    from apr.config.loader import config_hash
    from apr.plan.build import resolve_config
    from apr.train.run import ApplyOptions, prepare_run
    from tests.train.run_helpers import VOCAB, config_doc, make_dataset

    peft = pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = hf_model(tmp_path / "hf", family, vocab_size=VOCAB)
    write_tokenizer(tmp_path / "hf" / "tokenizer.json", VOCAB)
    make_dataset(tmp_path, train_rows=16, val_rows=4)

    def apply(out: str, resume=None) -> None:
        doc = config_doc(tmp_path, training={"max_steps": 4, "epochs": 1, "eval_interval": 0, "save_interval": 2,
                                             "output_dir": out})
        doc["model"] = {"init_from": str(tmp_path / "hf"), "lora": QLORA}
        cfg = AprConfig.model_validate(doc)
        run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                          options=ApplyOptions(resume=resume, echo=lambda line: None))
        assert run.execute().final_step == 4

    apply("qlora/")
    (tmp_path / "resumed").mkdir()
    for suffix in ("json", "safetensors"):
        shutil.copy(tmp_path / "qlora" / f"checkpoint-step-2.{suffix}", tmp_path / "resumed")
    apply(str(tmp_path / "resumed"), resume="latest")
    final, again = (load_file(str(tmp_path / d / "checkpoint-step-4.safetensors")) for d in ("qlora", "resumed"))
    assert set(again) == set(final) and all(again[k].equal(final[k]) for k in final)

    state = load_latest(tmp_path / "qlora")
    cfg = AprConfig.model_validate(state.info.config)
    engine = build_engine(plan_of(cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"engine": "standard"})})))
    engine.load_train_state_tensors(state.tensors)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = engine.model(ids)
    export_hf(tmp_path / "qlora", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert type(merged) is type(hf)
    torch.testing.assert_close(hf_logits(merged, ids), ours, atol=1e-5, rtol=0)
    result = export_hf(tmp_path / "qlora", tmp_path / "peft", fmt="peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(result.base))
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits.float(), ours, atol=1e-5, rtol=0)
        with model.disable_adapter():  # the adapters trained, over the NF4 base (not the folder's weights)
            torch.testing.assert_close(model(input_ids=ids).logits.float(), hf_logits(through_nf4(hf), ids),
                                       atol=1e-5, rtol=0)
            assert (model(input_ids=ids).logits.float() - ours).abs().max() > 1e-4
