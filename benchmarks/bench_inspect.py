"""Memory and time of `apr inspect`'s statistics and histograms on a large checkpoint
(docs/performance.md, "apr inspect: memory").

Writes a .safetensors file of Llama-7B-shaped tensors (hidden 4096, intermediate 11008, vocab 32000,
bf16; ``--blocks`` decoder blocks, 32 for the whole 7B model), then runs ``weight_stats`` over it
while a thread samples the process's anonymous memory (RssAnon: heap and torch tensors) and its
file-backed memory (RssFile: safetensors' memory map, page cache the kernel can drop) every 20 ms.
The claim is that RssAnon stays bounded by a few slices whatever the file's size.

    .venv/bin/python benchmarks/bench_inspect.py [--blocks 4] [--dir /tmp] [--keep] [--json] [--progress]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

from apr.checkpoint.sources import open_source
from apr.inspect.stats import weight_stats

H, I, V = 4096, 11008, 32000


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _shapes(blocks: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (V, H)), ("lm_head.weight", (V, H)), ("model.norm.weight", (H,))]
    for i in range(blocks):
        p = f"model.layers.{i}."
        out += [(p + name + ".weight", shape) for name, shape in (
            ("self_attn.q_proj", (H, H)), ("self_attn.k_proj", (H, H)), ("self_attn.v_proj", (H, H)),
            ("self_attn.o_proj", (H, H)), ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)),
            ("mlp.down_proj", (H, I)), ("input_layernorm", (H,)), ("post_attention_layernorm", (H,)))]
    return out


def write_checkpoint(path: Path, blocks: int) -> int:
    """A safetensors file written tensor by tensor (its 8-byte header length, JSON header, then each
    tensor's bytes), so writing a 13.5 GiB 7B checkpoint holds one tensor at a time. Norm weights are
    ones; matrices are 0.02 x standard normal, one random tensor per shape per 4 blocks reused (the
    statistics read every byte whatever they hold; drawing 7B normals would take longer than reading)."""
    shapes = _shapes(blocks)
    header, offset = {}, 0
    for name, shape in shapes:
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    pool: dict[tuple, torch.Tensor] = {}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i, (_name, shape) in enumerate(shapes):
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                key = (shape, i // 40)  # a new draw every ~4 blocks
                if key not in pool:
                    pool = {k: v for k, v in pool.items() if k[1] == key[1]}
                    pool[key] = torch.randn(shape, dtype=torch.bfloat16) * 0.02
                t = pool[key]
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    return sum(int(torch.Size(s).numel()) for _, s in shapes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--progress", action="store_true", help="a JSON line of memory every 20 s while measuring")
    args = ap.parse_args()
    path = Path(args.dir) / f"bench_inspect_{args.blocks}blocks.safetensors"
    if not path.exists():
        params = write_checkpoint(path, args.blocks)  # in a fresh process below: its tensors would count
        print(f"wrote {path} ({params / 1e9:.2f}B parameters); rerun to measure")
        return
    peak = {"RssAnon": 0, "RssFile": 0}
    before = _rss()
    done = threading.Event()

    def sample():
        shown = time.perf_counter()
        while not done.is_set():
            now = _rss()
            for k, v in now.items():
                peak[k] = max(peak[k], v)
            if args.progress and time.perf_counter() - shown > 20:
                shown = time.perf_counter()
                print(json.dumps({"t": round(shown - t0, 1), "anon": now["RssAnon"], "anon_peak": peak["RssAnon"],
                                  "file": now["RssFile"], "anon_before": before["RssAnon"]}), flush=True)
            time.sleep(0.02)

    t0 = time.perf_counter()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    layers, tensors = weight_stats(open_source(path), bins=40)
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    doc = {"file_bytes": path.stat().st_size, "parameters": sum(t.stats["numel"] for t in tensors),
           "layers": len(layers), "seconds": round(seconds, 2), "anon_before": before["RssAnon"],
           "anon_peak": peak["RssAnon"], "anon_growth": peak["RssAnon"] - before["RssAnon"],
           "file_backed_peak": peak["RssFile"], "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    if not args.keep:
        path.unlink()
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    gib = 2**30
    print(f"{doc['parameters'] / 1e9:.2f}B parameters, {doc['file_bytes'] / gib:.2f} GiB file, {len(layers)} layers: "
          f"{seconds:.1f} s; anonymous memory {before['RssAnon'] / gib:.2f} -> peak {peak['RssAnon'] / gib:.2f} GiB "
          f"(+{doc['anon_growth'] / 2**20:.0f} MiB); file-backed peak {peak['RssFile'] / gib:.2f} GiB")


if __name__ == "__main__":
    main()
