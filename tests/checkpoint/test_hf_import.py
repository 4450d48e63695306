"""model.init_from: a Hugging Face LLaMA folder made with transformers (or an apr checkpoint) is
imported with the same logits, trains like the standard engine, and bad sources are refused at plan
time with findings naming the file, the key and what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from apr.checkpoint.hf_import import ARCH_TO_HF, InitFromError, inspect_source, load_source_weights
from apr.plan.examples import write_tokenizer
from apr.steps.resolved import resolve as plan_of
from apr.train.build import build_engine
from tests.plan.plan_helpers import apr_cli
from tests.train.tiny import TINY, batches, make_config

transformers = pytest.importorskip("transformers")

ARCH = TINY["model"]["architecture"]


def hf_llama(folder: Path, seed: int = 3, shard: str | None = None, **over):
    """A random tiny LlamaForCausalLM saved with save_pretrained (safetensors), and the model."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=ARCH["hidden_size"], num_hidden_layers=ARCH["num_hidden_layers"],
        num_attention_heads=ARCH["num_attention_heads"], num_key_value_heads=ARCH["num_key_value_heads"],
        intermediate_size=ARCH["intermediate_size"], vocab_size=ARCH["vocab_size"],
        max_position_embeddings=ARCH["max_position_embeddings"], rms_norm_eps=1e-5, tie_word_embeddings=False,
        **over)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: make them matter in the comparison
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kw)
    return model


def config_for(folder: Path, **training):
    return make_config(model={"init_from": str(folder)}, training=training)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_imported_logits_equal_transformers(tmp_path, shard):
    hf = hf_llama(tmp_path / "hf", shard=shard)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert ("model.safetensors.index.json" in files) == (shard is not None)
    engine = build_engine(plan_of(config_for(tmp_path / "hf", engine="standard")))
    ids = batches(engine.config, 1)[0][:, :-1]
    with torch.no_grad():
        ours = engine.model(ids)
    theirs = hf_logits(hf, ids)
    assert ours.abs().max() > 0.1  # not a degenerate model
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_one_step_from_imported_weights_equals_the_standard_engine(tmp_path):
    hf_llama(tmp_path / "hf")
    data = batches(make_config(), 1, seed=5)
    after = {}
    for kind in ("interleaved", "standard"):
        engine = build_engine(plan_of(config_for(tmp_path / "hf", engine=kind)))
        loss = engine.train_step(data, lr=1e-2).loss
        after[kind] = ({k: v.clone() for k, v in engine.train_state_tensors().items() if "optimizer" not in k},
                       float(loss))
    (wi, li), (ws, ls) = after["interleaved"], after["standard"]
    assert li == pytest.approx(ls, rel=1e-6)
    for k in ws:
        torch.testing.assert_close(wi[k], ws[k], atol=1e-6, rtol=1e-6)
    start = load_source_weights(str(tmp_path / "hf"), make_config().model.architecture)
    assert max((ws[k] - start[k]).abs().max() for k in ws) > 1e-3  # the step moved the imported weights


def test_init_from_an_apr_checkpoint_loads_its_weights(tmp_path):
    from apr.checkpoint.manager import CheckpointManager, TrainState

    config = make_config()
    trained = build_engine(plan_of(config))
    trained.train_step(batches(config, 1), lr=1e-2)
    tensors = trained.train_state_tensors()
    CheckpointManager(tmp_path / "run", config).save(TrainState(step=1, tensors=tensors, meta={}))
    started = build_engine(plan_of(config_for(tmp_path / "run")))
    for name, t in started.train_state_tensors().items():
        if name.startswith("optimizer."):
            assert not t.any()  # a run started from weights begins its own AdamW moments
        else:
            assert torch.equal(t, tensors[name]), name


def test_export_and_import_share_one_key_table():
    from apr.checkpoint.export import hf_config

    arch = make_config().model.architecture
    doc, _ = hf_config(arch, {"eos": None, "bos": None, "pad": None, "unk": None}, 5)
    assert {k: doc[k] for _, k in ARCH_TO_HF} == {k: getattr(arch, a) for a, k in ARCH_TO_HF}
    from apr.checkpoint.hf_import import architecture_fields
    from apr.config.schema import Architecture

    for major in (4, 5):  # rope_theta at the top level (4.x) or in rope_parameters (5.x)
        doc, _ = hf_config(arch, {"eos": None, "bos": None, "pad": None, "unk": None}, major)
        assert Architecture.model_validate(architecture_fields(doc)) == arch  # generate reads it back


# --------------------------------------------------------------------------------- bad sources


def write_plan_config(tmp_path: Path, init_from: Path, **arch_over) -> Path:
    from apr.data.testing import make_shards

    make_shards(tmp_path / "data", n_rows=64, seq_len=12, vocab_size=ARCH["vocab_size"])
    doc = {"model": {"init_from": str(init_from), "architecture": {**ARCH, **arch_over}},
           "data": {"train": str(tmp_path / "data" / "train"), "batch_size": 2, "seq_len": 12},
           "training": {"device": "cpu", "output_dir": str(tmp_path / "out"), "max_steps": 2}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def plan_json(tmp_path: Path, cfg: Path) -> tuple[int, dict]:
    r = apr_cli("train", "plan", str(cfg), "--json", cwd=tmp_path)
    assert "Traceback" not in r.stderr
    return r.returncode, json.loads(r.stdout)


def codes(doc: dict) -> list[str]:
    return [f["code"] for f in doc["findings"] if f["severity"] == "error"]


def test_plan_reads_the_source_from_headers_and_its_tokenizer_travels(tmp_path):
    hf_llama(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf" / "tokenizer.json", ARCH["vocab_size"], added_tokens=3)  # 3 ids too many
    rc, doc = plan_json(tmp_path, write_plan_config(tmp_path, tmp_path / "hf"))
    facts = doc["facts"]["init_from"]
    assert facts["kind"] == "hf" and facts["errors"] == 0
    n_params = doc["facts"]["model"]["params"]
    assert facts["params"] == n_params and facts["bytes"] == 4 * n_params  # save_pretrained wrote float32
    assert facts["tokenizer"].endswith("hf/tokenizer.json")
    assert rc == 1 and codes(doc) == ["C-TOK-002"]  # the vocab contract applies to the travelling tokenizer
    assert not (tmp_path / "out").exists()


def test_architecture_mismatches_are_one_finding_each_at_their_keys(tmp_path):
    hf_llama(tmp_path / "hf")
    cfg = write_plan_config(tmp_path, tmp_path / "hf", intermediate_size=96, rope_theta=500000.0)
    rc, doc = plan_json(tmp_path, cfg)
    found = [f for f in doc["findings"] if f["code"] == "init_from.architecture_mismatch"]
    assert rc == 1 and sorted(f["path"] for f in found) == ["model.architecture.intermediate_size",
                                                           "model.architecture.rope_theta"]
    inter = next(f for f in found if f["path"].endswith("intermediate_size"))
    assert inter["expected"] == "64" and inter["got"] == "96" and "config.json" in inter["message"]
    lines = cfg.read_text().splitlines()
    assert "intermediate_size" in lines[inter["line"] - 1]
    # the shapes that follow from it are named too, file and tensor
    shapes = [f for f in doc["findings"] if f["code"] == "init_from.shape"]
    assert shapes and "model.layers.0.mlp.gate_proj.weight" in shapes[0]["message"]
    assert "model.safetensors" in shapes[0]["message"]


def test_a_pickle_file_is_refused_naming_it(tmp_path):
    hf_llama(tmp_path / "hf")
    folder = tmp_path / "hf"
    (folder / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    rc, doc = plan_json(tmp_path, write_plan_config(tmp_path, folder))
    f = next(f for f in doc["findings"] if f["code"] == "init_from.pickle")
    assert rc == 1 and "pytorch_model.bin" in f["message"] and "never unpickles" in f["message"]
    assert f["path"] == "model.init_from" and f["line"] is not None
    with pytest.raises(InitFromError, match="pytorch_model.bin"):
        load_source_weights(str(folder / "pytorch_model.bin"), make_config().model.architecture)


def test_gpt2_names_are_refused_naming_file_and_tensor(tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    save_file({"transformer.h.0.attn.c_attn.weight": torch.zeros(32, 96)}, folder / "model.safetensors")
    arch = make_config().model.architecture
    src = inspect_source(str(folder), arch)
    assert [f.code for f in src.findings] == ["init_from.architecture"]
    assert "'gpt2'" in src.findings[0].message and src.findings[0].got == "'gpt2'"
    # a llama config.json over GPT-2 tensors: the tensor is named with its file
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    src = inspect_source(str(folder), arch)
    foreign = [f for f in src.findings if f.code == "init_from.foreign_tensor"]
    assert foreign and "transformer.h.0.attn.c_attn.weight" in foreign[0].message
    assert "model.safetensors" in foreign[0].message and "another architecture" in foreign[0].message
    assert any(f.code == "init_from.missing_tensor" for f in src.findings)
    rc, doc = plan_json(tmp_path, write_plan_config(tmp_path, folder))
    assert rc == 1 and "init_from.foreign_tensor" in codes(doc)


def test_a_shape_edited_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_llama(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, path, metadata={"format": "pt"})
    src = inspect_source(str(tmp_path / "hf"), make_config().model.architecture)
    assert [f.code for f in src.findings] == ["init_from.shape"]
    assert src.findings[0].got == "[8, 32]" and src.findings[0].expected == "[16, 32]"
    with pytest.raises(InitFromError):
        build_engine(plan_of(config_for(tmp_path / "hf")))


def test_missing_source_is_a_finding(tmp_path):
    src = inspect_source(str(tmp_path / "nope"), make_config().model.architecture)
    assert [f.code for f in src.findings] == ["init_from.missing"]


@pytest.mark.parametrize("edit,key", [
    # transformers 4.x form: a type apr does not compute, the older "type" spelling, keys a type needs
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling.type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"factor": 4.0}}, "rope_scaling.factor"),  # no type: still a scaling
    ({"rope_scaling": "yarn"}, "rope_scaling"),
    # transformers 5.x form: rope_parameters carries the type, and rope_scaling can be null
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_theta": 10000.0}, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling.low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 16}, "head_dim"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
])
def test_hf_keys_that_change_the_math_are_refused_by_every_reader(tmp_path, edit, key):
    """A config.json apr would otherwise import as plain RoPE / bias-free LLaMA (computing other
    logits than transformers) is refused at plan (init_from), by generate and as a distillation teacher,
    each naming the key and its value."""
    from apr.checkpoint.hf_import import source_architecture
    from apr.checkpoint.sources import SourceError
    from apr.generate.load import load_for_inference

    folder = tmp_path / "hf"
    hf_llama(folder)
    cfg_path = folder / "config.json"
    doc = json.loads(cfg_path.read_text())
    doc.update(edit)
    cfg_path.write_text(json.dumps(doc))
    arch = config_for(folder).model.architecture
    src = inspect_source(str(folder), arch)
    found = [f for f in src.findings if f.code == "init_from.architecture" and key in f.got]
    assert found, [f.message for f in src.findings]
    assert repr(doc[key.split(".")[0]]) in found[0].message or key in found[0].message
    with pytest.raises(SourceError, match=key.replace(".", r"\.")):
        load_for_inference(folder, need_tokenizer=False)
    with pytest.raises(InitFromError, match=key.replace(".", r"\.")):
        source_architecture(str(folder))


def test_a_plain_rope_config_written_by_transformers_passes(tmp_path):
    """The checks refuse only what changes the math: transformers' own plain LLaMA (rope_parameters
    with rope_type default, head_dim = hidden / heads, no biases) is imported."""
    hf_llama(tmp_path / "hf")
    src = inspect_source(str(tmp_path / "hf"), config_for(tmp_path / "hf").model.architecture)
    assert not src.findings, [f.message for f in src.findings]


def test_a_sharded_folder_missing_a_shard_is_refused_at_the_key_naming_the_index(tmp_path):
    hf_llama(tmp_path / "hf", shard="20KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    src = inspect_source(str(tmp_path / "hf"), config_for(tmp_path / "hf").model.architecture)
    assert [f.code for f in src.findings] == ["init_from.missing_shard"]
    f = src.findings[0]
    assert f.path == "model.init_from" and f.file.endswith("model.safetensors.index.json")
    assert shards[-1].name in f.message
    with pytest.raises(InitFromError, match=shards[-1].name):
        load_source_weights(str(tmp_path / "hf"), make_config().model.architecture)
