"""Export to a Hugging Face folder, load it with transformers offline, compare logits, generate."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import pytest
import torch

from apr.checkpoint.export import export_hf, hf_config
from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState
from apr.errors import AprError
from apr.model.spec import param_specs
from tests.checkpoint.conftest import make_config

ARCH = {
    "model.architecture.hidden_size": 32, "model.architecture.num_attention_heads": 4,
    "model.architecture.num_key_value_heads": 2, "model.architecture.intermediate_size": 48,
    "model.architecture.vocab_size": 300, "model.architecture.max_position_embeddings": 64,
    "model.architecture.rope_theta": 500000.0, "model.architecture.rms_norm_eps": 1e-5,
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A small byte-level BPE with an end-of-text token, trained on stdlib sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"))), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def weights(config, seed=0):
    """Trained-looking random weights: small matrices, norms near one; AdamW state alongside."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in param_specs(config.model.architecture):
        if len(p.shape) == 1:
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            t = 0.08 * torch.randn(p.shape, generator=g)
        out[p.name] = t
        out["optimizer.m." + p.name] = torch.randn(p.shape, generator=g)
        out["optimizer.v." + p.name] = torch.rand(p.shape, generator=g)
    return out


def reference_logits(t: dict, arch, ids: torch.Tensor) -> torch.Tensor:
    """A plain Llama forward written from the paper's equations (float32)."""
    B, T = ids.shape
    nq, nkv = arch.num_attention_heads, arch.kv_heads
    hd = arch.hidden_size // nq
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + arch.rms_norm_eps))

    def rope(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    mask = torch.full((T, T), float("-inf")).triu(1)
    h = t["model.embed_tokens.weight"][ids]
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = (x @ t[p + "self_attn.q_proj.weight"].T).view(B, T, nq, hd).transpose(1, 2)
        k = (x @ t[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
        v = (x @ t[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5 + mask, -1) @ v
        h = h + att.transpose(1, 2).reshape(B, T, nq * hd) @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ t[p + "mlp.gate_proj.weight"].T)
        h = h + (gate * (x @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    h = rms(h, t["model.norm.weight"])
    return h @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


def saved_checkpoint(tmp_path, tokenizer_file, tied):
    config = make_config(**ARCH, **{"model.architecture.tie_word_embeddings": tied,
                                    "data.tokenizer": str(tokenizer_file)})
    tensors = weights(config)
    path = CheckpointManager(tmp_path / "run", config).save(TrainState(12, tensors, {"epoch": 0}))
    return config, tensors, path


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_the_export_with_equal_logits_and_generates(tmp_path, tokenizer_file, tied,
                                                                       monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, tensors, ckpt = saved_checkpoint(tmp_path, tokenizer_file, tied)
    out = tmp_path / "hf"
    result = export_hf(ckpt, out)
    assert result.files == ["config.json", "generation_config.json", "model.safetensors",
                            "tokenizer.json", "tokenizer_config.json"]
    stored = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("optimizer.") for k in stored)
    assert ("lm_head.weight" in stored) is (not tied)

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert model.config.tie_word_embeddings is tied
    assert model.dtype == torch.float32
    arch = config.model.architecture
    ids = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).logits
    want = reference_logits({k: v for k, v in tensors.items() if not k.startswith("opt")}, arch, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    text = "def f(x):\n    return x + 1\n"
    enc = tok(text, return_tensors="pt")
    assert tok.decode(enc["input_ids"][0]) == text
    gen = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert gen.shape[0] == 1 and enc["input_ids"].shape[1] < gen.shape[1] <= enc["input_ids"].shape[1] + 6
    first = reference_logits({k: v for k, v in tensors.items() if not k.startswith("opt")}, arch,
                             enc["input_ids"])[0, -1].argmax().item()
    assert gen[0, enc["input_ids"].shape[1]].item() == first  # greedy: the reference's next token


def test_a_bf16_state_checkpoint_exports_float32_weights_equal_to_its_bf16_values(tmp_path, tokenizer_file):
    """training.state_dtype: bf16 checkpoints hold bf16 tensors; the export is float32, as its config.json says."""
    from safetensors.torch import load_file

    config = make_config(**ARCH, **{"data.tokenizer": str(tokenizer_file), "training.mixed_precision": "bf16",
                                    "training.state_dtype": "bf16"})
    tensors = {k: v.bfloat16() for k, v in weights(config).items()}
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(12, tensors, {"epoch": 0}))
    assert {t.dtype for t in load_file(str(ckpt.with_suffix(".safetensors"))).values()} == {torch.bfloat16}
    export_hf(ckpt, tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert exported.keys() == {k for k in tensors if not k.startswith("optimizer.")}
    assert all(torch.equal(exported[k], tensors[k].float()) for k in exported)
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert doc.get("torch_dtype", doc.get("dtype")) == "float32"


def test_config_json_uses_the_installed_transformers_rope_form(tmp_path, tokenizer_file):
    config, _, ckpt = saved_checkpoint(tmp_path, tokenizer_file, tied=False)
    export_hf(ckpt, tmp_path / "hf")
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    from importlib.metadata import version

    if int(version("transformers").split(".")[0]) >= 5:
        assert doc["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
        assert "rope_theta" not in doc
    else:
        assert doc["rope_theta"] == 500000.0
    assert doc["num_key_value_heads"] == 2 and doc["head_dim"] == 8 and doc["eos_token_id"] == 0
    v4, _ = hf_config(config.model.architecture, {"eos": None, "bos": None, "pad": None, "unk": None}, 4)
    assert v4["rope_theta"] == 500000.0 and "rope_parameters" not in v4
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["pad_token_id"] == 0
    tc = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|endoftext|>" and tc["model_max_length"] == 64


def test_export_refusals(tmp_path, tokenizer_file):
    config, _, ckpt = saved_checkpoint(tmp_path, tokenizer_file, tied=True)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(AprError, match="--overwrite"):
        export_hf(ckpt, out)
    with pytest.raises(AprError, match="not an earlier export"):  # --overwrite never deletes foreign files
        export_hf(ckpt, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "x"
    out = tmp_path / "hf2"
    export_hf(ckpt, out)
    (out / "config.json").write_text("{}")
    export_hf(ckpt, out, overwrite=True)  # an earlier export is replaced
    assert json.loads((out / "config.json").read_text()) and (out / "model.safetensors").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # as readable as any file
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    with pytest.raises(AprError, match="not found"):
        export_hf(ckpt, tmp_path / "b", tokenizer=tmp_path / "nope.json")
    small_vocab = tmp_path / "t.json"
    small_vocab.write_text("not a tokenizer")
    with pytest.raises(AprError, match="not a tokenizers"):
        export_hf(ckpt, tmp_path / "c", tokenizer=small_vocab)
    weights_file = ckpt.with_suffix(".safetensors")
    weights_file.write_bytes(weights_file.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        export_hf(ckpt, tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf2", "run", "t.json"]  # no temp folders left


def test_run_directory_exports_its_latest_good_checkpoint_with_a_relative_tokenizer(
        tmp_path, tokenizer_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok.json").write_bytes(tokenizer_file.read_bytes())
    config = make_config(**ARCH, **{"data.tokenizer": "tok.json"})
    mgr = CheckpointManager(tmp_path / "run", config, keep_last=2)
    mgr.save(TrainState(5, weights(config, 5), {}))
    mgr.save(TrainState(9, weights(config, 9), {}))
    (tmp_path / "run" / "checkpoint-step-9.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.chdir(tmp_path / "run")  # the relative tokenizer path is found through the recorded cwd
    result = export_hf(tmp_path / "run", tmp_path / "hf")
    assert result.step == 5
    assert any("checkpoint-step-9" in w for w in result.warnings)


def test_overwrite_refuses_an_export_folder_a_user_added_files_to(tmp_path, tokenizer_file):
    _, _, ckpt = saved_checkpoint(tmp_path, tokenizer_file, tied=True)
    out = tmp_path / "hf"
    export_hf(ckpt, out)
    (out / "README.md").write_text("my notes")  # next to the exported files
    with pytest.raises(AprError, match="did not write"):
        export_hf(ckpt, out, overwrite=True)
    assert (out / "README.md").read_text() == "my notes" and (out / "model.safetensors").exists()


def test_a_killed_exports_temp_folder_is_removed_by_the_next_export(tmp_path, tokenizer_file):
    import subprocess
    import sys

    _, _, ckpt = saved_checkpoint(tmp_path, tokenizer_file, tied=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    leftover = tmp_path / f".hf.export-{pid}.tmp"  # what a SIGKILL mid-export leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    export_hf(ckpt, tmp_path / "hf")
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == []


@pytest.mark.parametrize(("signame", "code"), [("SIGTERM", -15), ("SIGHUP", -1), ("SIGINT", 1)])
def test_an_export_killed_by_a_signal_leaves_no_temp_folder(tmp_path, tokenizer_file, signame, code):
    """The signal arrives mid-write (from inside write_safetensors); the export unwinds, removes its
    temp folder, keeps an earlier export in place, and the process still ends by that signal."""
    import subprocess
    import sys

    _, _, ckpt = saved_checkpoint(tmp_path, tokenizer_file, tied=True)
    out = tmp_path / "hf"
    export_hf(ckpt, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    script = f"""
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (a background job ignores it)
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # and under nohup (a CI runner's job) SIGHUP is ignored too
from apr.checkpoint import export, files
real = files.write_safetensors
def interrupted(path, *a, **k):
    real(path, *a, **k)
    os.kill(os.getpid(), signal.{signame})
files.write_safetensors = interrupted
try:
    export.export_hf({str(ckpt)!r}, {str(out)!r}, overwrite=True)
except KeyboardInterrupt:
    raise SystemExit(1)
raise SystemExit(0)
"""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr or signame == "SIGINT"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == []
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_decoupled_attention_checkpoint_is_refused_with_nothing_written(tmp_path, tokenizer_file):
    """Hugging Face LLaMA has no form for decoupled bottleneck attention: the export names the key."""
    config = make_config(**ARCH, **{"model.architecture.decoupled_attention": {"sem_dim": 2, "geo_dim": 4},
                                    "data.tokenizer": str(tokenizer_file)})
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(3, weights(config), {"epoch": 0}))
    with pytest.raises(AprError) as err:
        export_hf(ckpt, tmp_path / "hf")
    assert err.value.findings[0].path == "model.architecture.decoupled_attention"
    assert not (tmp_path / "hf").exists()


MLA = {"kind": "mla", "kv_lora_rank": 12, "qk_rope_head_dim": 4, "q_lora_rank": 6}


def test_latent_attention_exports_as_deepseek_v3_with_apr_s_logits(tmp_path, tokenizer_file, monkeypatch):
    """model.architecture.attention: {kind: mla} exports as DeepseekV3ForCausalLM (dense MLPs in every
    layer, RoPE halves as apr rotates them): its logits are apr's model's on the same weights; with a
    mixture of experts (DeepSeek's is not apr's) it is refused, nothing written."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from apr.model.llama import LlamaForCausalLM

    over = {"model.architecture.num_key_value_heads": None, "model.architecture.attention": MLA,
            "data.tokenizer": str(tokenizer_file)}
    config = make_config(**{**ARCH, **over})
    tensors = weights(config)
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(5, tensors, {"epoch": 0}))
    export_hf(ckpt, tmp_path / "hf")
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (doc["architectures"], doc["kv_lora_rank"], doc["q_lora_rank"], doc["qk_rope_head_dim"],
            doc["qk_nope_head_dim"], doc["v_head_dim"]) == (["DeepseekV3ForCausalLM"], 12, 6, 4, 4, 8)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = LlamaForCausalLM(config.model.architecture)
    ours.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(ids).logits, ours(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    cfg = make_config(**{**ARCH, **over, "model.architecture.moe": {"num_experts": 4, "top_k": 2}})
    path = CheckpointManager(tmp_path / "moe", cfg).save(TrainState(5, weights(cfg), {"epoch": 0}))
    with pytest.raises(AprError) as err:
        export_hf(path, tmp_path / "hf-moe")
    assert err.value.findings[0].path == "model.architecture.moe" and "DeepseekV3" in str(err.value)
    assert not (tmp_path / "hf-moe").exists()


MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 16, "balance_loss_coef": 0.02}


@pytest.mark.slow
def test_a_mixture_of_experts_exports_as_mixtral_with_apr_s_logits(tmp_path, tokenizer_file, monkeypatch):
    """model.architecture.moe exports as MixtralForCausalLM (per-expert w1/w2/w3, which transformers 5
    converts on load): its logits are apr's model's on the same weights; qwen2's biases have no Mixtral
    form and PEFT none here: refused, nothing written."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from apr.model.llama import LlamaForCausalLM

    config = make_config(**ARCH, **{"model.architecture.moe": MOE, "data.tokenizer": str(tokenizer_file)})
    tensors = weights(config)
    ckpt = CheckpointManager(tmp_path / "run", config).save(TrainState(5, tensors, {"epoch": 0}))
    export_hf(ckpt, tmp_path / "hf")
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (doc["architectures"], doc["num_local_experts"], doc["num_experts_per_tok"], doc["intermediate_size"],
            doc["router_aux_loss_coef"]) == (["MixtralForCausalLM"], 4, 2, 16, 0.01)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = LlamaForCausalLM(config.model.architecture)
    ours.load_state_dict({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(ids).logits, ours(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    for name, over, fmt in (("qwen2", {"model.architecture.family": "qwen2"}, "hf"), ("peft", {}, "peft")):
        cfg = make_config(**ARCH, **{"model.architecture.moe": MOE, "data.tokenizer": str(tokenizer_file), **over})
        path = CheckpointManager(tmp_path / name, cfg).save(TrainState(5, weights(cfg), {"epoch": 0}))
        with pytest.raises(AprError) as err:
            export_hf(path, tmp_path / f"hf-{name}", fmt=fmt)
        assert err.value.findings[0].path == "model.architecture.moe", name
        assert not (tmp_path / f"hf-{name}").exists()
