"""A tiny language model that has memorised a few hundred lines of stdlib source, its tokenizer,
an apr checkpoint of it and its Hugging Face export. Built once per test session (a few seconds)."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

CONTEXT = 96
SEQ = 96  # the whole context: positions the model never trained on would score badly
# 200 steps left one line only half-memorised under another tokenizers release (its real next line
# lost to a distractor on acc_norm); 300 leave a margin of ~6 nats on the sum, ~0.2 per character
STEPS = 300


@dataclass
class TinyLM:
    tokenizer: Path
    run_dir: Path
    checkpoint: Path  # the step checkpoint's JSON
    hf_dir: Path
    lines: list[str]  # the memorised text, line by line
    config: object
    steps: int  # the checkpoint's step


def training_lines() -> list[str]:
    """Distinct, non-blank lines of a stdlib module: the text the model memorises."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py").read_text()
    seen, out = set(), []
    for line in text.splitlines():
        if len(line.strip()) >= 12 and line not in seen:
            seen.add(line)
            out.append(line)
    return out[:24]


def train_tokenizer(path: Path) -> Path:
    import glob
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"))), trainer)
    tok.save(str(path))
    return path


def config_doc(tokenizer: Path) -> dict:
    return {
        "model": {"architecture": {
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 384, "max_position_embeddings": CONTEXT}},
        "data": {"train": "data/train/", "batch_size": 8, "seq_len": SEQ, "tokenizer": str(tokenizer)},
        "training": {"mixed_precision": "fp32", "device": "cpu", "kernels": "torch", "seed": 5},
    }


def build(root: Path, steps: int = STEPS) -> TinyLM:
    import torch
    from tokenizers import Tokenizer

    from apr.checkpoint.export import export_hf
    from apr.checkpoint.manager import CheckpointManager, TrainState
    from apr.config.schema import AprConfig
    from apr.model.llama import build_model

    root.mkdir(parents=True, exist_ok=True)
    tok_path = train_tokenizer(root / "tokenizer.json")
    tok = Tokenizer.from_file(str(tok_path))
    config = AprConfig.model_validate(config_doc(tok_path))
    lines = training_lines()
    text = "\n".join(lines) + "\n"
    stream = tok.encode(text + text).ids  # twice, so a window from any line start is full
    # one window from the start of each line: every line is memorised from any earlier line on
    starts, pos = [], 0
    for line in lines:
        starts.append(len(tok.encode(text[:pos]).ids) if pos else 0)
        pos += len(line) + 1
    rows = torch.tensor([stream[i:i + SEQ + 1] for i in starts])
    torch.manual_seed(0)
    model = build_model(config.model.architecture, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains several times faster on one thread
    try:
        for _ in range(steps):
            loss = model(rows[:, :-1], rows[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    tensors = {}
    for name, p in model.named_parameters():
        tensors[name] = p.detach().clone()
        tensors["optimizer.m." + name] = torch.zeros_like(p)
        tensors["optimizer.v." + name] = torch.zeros_like(p)
    ckpt = CheckpointManager(root / "run", config).save(TrainState(steps, tensors, {"final_loss": loss.item()}))
    hf = export_hf(ckpt, root / "hf").out_dir
    return TinyLM(tokenizer=tok_path, run_dir=root / "run", checkpoint=ckpt, hf_dir=hf, lines=lines, config=config,
                  steps=steps)


_BUILT: dict[str, TinyLM] = {}


def session_tiny_lm(tmp_path_factory) -> TinyLM:
    """One TinyLM per test process, shared by every folder's session fixture."""
    if "lm" not in _BUILT:
        _BUILT["lm"] = build(tmp_path_factory.mktemp("tiny_lm"))
    return _BUILT["lm"]


def shard_hf(folder: Path, out: Path, shards: int = 2) -> Path:
    """A copy of ``folder`` (an `apr export` Hugging Face folder) with its weights split over
    ``shards`` files named by a ``model.safetensors.index.json``, as save_pretrained writes a model
    larger than its max_shard_size."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[i::shards]}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names[i::shards], file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
