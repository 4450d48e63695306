"""Speed of `apr generate` against transformers' `generate` on the same exported model
(docs/performance.md, "Generation").

A LLaMA-style model (random weights, float32) is saved as an apr checkpoint and exported with
`apr export`; apr loads the checkpoint, transformers loads the export (`from_pretrained`). Both
continue the same prompts (`--prompt-tokens` tokens each) for exactly `--new-tokens` tokens (the
end-of-text token is ignored by both), greedy and sampled (temperature 0.8, top-k 50, top-p 0.95),
batch 1 and batch 4, on the same device. Runs alternate apr / transformers; the median of
`--repeats` is reported as generated tokens per second (prefill included), with the ratio
apr / transformers. Greedy outputs are checked to be the same tokens.

    .venv/bin/python benchmarks/bench_generate.py [--size small|medium] [--new-tokens 128] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIZES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "small": (256, 4, 4, 2, 688, 4096),
    "medium": (512, 8, 8, 4, 1376, 8192),
    "large": (1024, 24, 16, 4, 4096, 32768),  # the 350M reference shape
}


def make_model(tmp: Path, size: str):
    import torch

    from apr.checkpoint.export import export_hf
    from apr.checkpoint.manager import CheckpointManager, TrainState
    from apr.config.schema import AprConfig
    from apr.data.corpus import builtin_corpus_files
    from apr.data.tokenizer import train_tokenizer
    from apr.model.llama import build_model

    h, layers, heads, kv, inter, vocab = SIZES[size]
    docs = [f.read_text(encoding="utf-8") for f in builtin_corpus_files("stdlib", 1_000_000)]
    tok = tmp / "tokenizer.json"
    train_tokenizer(docs, vocab, tok)
    config = AprConfig.model_validate({
        "model": {"architecture": {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
                                   "num_key_value_heads": kv, "intermediate_size": inter, "vocab_size": vocab,
                                   "max_position_embeddings": 1024}},
        "data": {"train": "unused/", "batch_size": 1, "seq_len": 1024, "tokenizer": str(tok)},
        "training": {"mixed_precision": "fp32", "device": "cpu"},
    })
    model = build_model(config.model.architecture, seed=0)
    tensors = {}
    for name, p in model.named_parameters():
        tensors[name] = p.detach()
        tensors["optimizer.m." + name] = torch.zeros_like(p)
        tensors["optimizer.v." + name] = torch.zeros_like(p)
    ckpt = CheckpointManager(tmp / "run", config).save(TrainState(1, tensors))
    hf = export_hf(ckpt, tmp / "hf").out_dir
    return ckpt, hf, docs


def prompts_of(loaded, docs: list[str], n: int, tokens: int) -> list[str]:
    """``n`` prompts that encode to exactly ``tokens`` tokens each."""
    out = []
    for doc in docs:
        ids = loaded.tokenizer.encode(doc).ids
        for start in range(0, len(ids) - tokens, 97):
            text = loaded.tokenizer.decode(ids[start:start + tokens])
            if text.strip() and len(loaded.tokenizer.encode(text).ids) == tokens:
                out.append(text)
                break
        if len(out) == n:
            return out
    raise SystemExit("not enough prompts")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from apr.generate.generate import GenerateOptions, generate
    from apr.generate.load import load_for_inference
    from apr.generate.sampling import Sampling

    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        ckpt, hf_dir, docs = make_model(tmp, args.size)
        loaded = load_for_inference(ckpt, device=args.device)
        params = sum(p.numel() for p in loaded.model.parameters())
        hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).to(args.device).eval()
        hf.generation_config.eos_token_id = None  # both run exactly --new-tokens tokens
        hf.generation_config.pad_token_id = 0
        print(f"model: {args.size}, {params / 1e6:.1f}M parameters, float32, {args.device}; "
              f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of {args.repeats}")
        print(f"{'case':<22} {'apr tok/s':>10} {'hf tok/s':>10} {'apr/hf':>7}  same tokens")
        n = args.new_tokens
        for batch in (1, 4):
            prompts = prompts_of(loaded, docs, batch, args.prompt_tokens)
            ids = torch.tensor([loaded.tokenizer.encode(p).ids for p in prompts], device=args.device)
            mask = torch.ones_like(ids)
            for label, sampling, hf_kw in (
                ("greedy", Sampling(temperature=0), {"do_sample": False}),
                ("sample t0.8 k50 p0.95", Sampling(temperature=0.8, top_k=50, top_p=0.95),
                 {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95}),
            ):
                options = GenerateOptions(max_new_tokens=n, sampling=sampling, seed=0, stop_at_eos=False)
                apr_s, hf_s = [], []
                apr_out = hf_out = None
                for _ in range(args.repeats + 1):  # the first pair warms up
                    t0 = time.perf_counter()
                    result = generate(loaded, prompts, options)
                    apr_s.append(time.perf_counter() - t0)
                    apr_out = [g.token_ids for g in result.generations]
                    torch.manual_seed(0)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, **hf_kw)
                    hf_s.append(time.perf_counter() - t0)
                    hf_out = out[:, ids.shape[1]:].tolist()
                a, h = statistics.median(apr_s[1:]), statistics.median(hf_s[1:])
                # sampled runs draw from the same seeded CPU stream, so they usually agree too
                same = "yes" if apr_out == hf_out else ("no (sampled)" if hf_kw["do_sample"] else "NO")
                case = f"{label} b{batch}"
                print(f"{case:<22} {batch * n / a:>10.1f} {batch * n / h:>10.1f} {h / a:>6.2f}x  {same}")


if __name__ == "__main__":
    main()
