"""`apr train plan --trace` at full size: plan / trace ratios, time and RSS (docs/plan.md, "Trace").

    .venv/bin/python benchmarks/bench_trace.py [350m] [7b-fsdp8] [50m-matrix]

Each case runs in a fresh process (the RSS is the trace's own). The 350M case is the reference config
(configs/train/pretrain-350m-v2.yaml) on stand-in data as planned for an H100; the 7B case is a LLaMA
shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 11008) at rank 0 of 8 with
training.sharding=full.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "350m": {"config": "configs/train/pretrain-350m-v2.yaml", "gpu": "h100", "over": {}},
    "7b-fsdp8": {"config": "configs/train/pretrain-350m-v2.yaml", "gpu": "h100", "world_size": 8, "over": {
        "model": {"architecture": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                                   "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000,
                                   "max_position_embeddings": 4096}},
        "data": {"batch_size": 4, "seq_len": 1024},
        "training": {"sharding": "full", "world_size": 8, "gradient_accumulation": 1}}},
}
for name, training in (("keep", {"execution": {"activations": "keep"}}),
                       ("recompute", {"execution": {"activations": "recompute"}}),
                       ("selective", {"execution": {"activations": "selective"}}),
                       ("standard", {"engine": "standard"})):
    CASES[f"50m-{name}"] = {"config": "configs/train/pretrain-50m.yaml", "over": {"training": training}}

WORKER = r"""
import json, sys, time
import yaml
from apr.config.schema import AprConfig
from apr.memory.table import memory_table
from apr.plan.memory import choose_execution
from apr.trace import run_trace
from apr.steps.resolved import resolve
from apr.plan.examples import deep_merge
case = json.loads(sys.argv[1])
doc = yaml.safe_load(open(case["config"]))
doc = deep_merge(doc, case["over"])
doc["data"]["train"] = "stand-in/"
for key in ("val", "tokenizer"):
    doc["data"].pop(key, None)
doc["training"]["device"] = "cpu" if not case.get("gpu") else "cuda"
config = AprConfig.model_validate(doc)
laid_out = resolve(config, world_size=case.get("world_size")).config
budget = 80 * 2**30 if case.get("gpu") == "h100" else None  # the catalogue's H100: 80 GiB
execution = choose_execution(laid_out, budget).execution
resolved = resolve(config, world_size=case.get("world_size"), execution=execution)
rows = memory_table(resolved.config, execution=resolved.execution)
t0 = time.perf_counter()
out = run_trace(resolved, plan_rows=rows)
out["wall_s"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""


def run(name: str) -> dict:
    case = CASES[name]
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(case)], capture_output=True, text=True,
                          cwd=ROOT, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(line[len("RESULT "):])


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        r = run(name)
        if "error" in r:
            print(f"{name}: failed: {r['error']}")
            continue
        rows = ", ".join(f"{x['name']} {x['ratio']:.2f}" for x in r["rows"] if x.get("ratio"))
        print(f"{name}: plan/trace peak {r['ratio']:.3f} (plan {r['plan_peak_bytes'] / 2**30:.2f} GiB, traced "
              f"{r['peak_bytes'] / 2**30:.2f} GiB); rows {rows}; {r['wall_s']:.1f} s, RSS {r['rss'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
