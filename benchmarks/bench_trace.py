"""`apr train plan --trace` at full size: plan / trace ratios, time and RSS (docs/plan.md, "Trace").

    .venv/bin/python benchmarks/bench_trace.py [CASE ...] [--check]     (default: every full-size case)
    .venv/bin/python benchmarks/bench_trace.py small --check             (the small matrix CI does not run)
    .venv/bin/python benchmarks/bench_trace.py --probe-table PLAN.json ...

Each case runs in a fresh process (the RSS is the trace's own). The 350M case is the reference config
(configs/train/pretrain-350m-v2.yaml) on stand-in data as planned for an H100; the 7B case is a LLaMA
shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 11008) at rank 0 of 8 with
training.sharding=full. The 50M cases are configs/train/pretrain-50m.yaml: the activation policies,
LoRA, the last stage of progressive stacking, a distillation student (phase 2, a 24-block teacher of
the same width), shard_grad_op and hybrid sharding on 8 fake ranks, and `--probe --trace` through the
CLI (the probe's real CPU step beside the trace). The `small-*` cases are the small shape of
tests/test_trace.py (its ``SMALL``) in the combinations CI leaves out; `small` names them all.

`--check` holds each case to the bounds tests/test_trace.py holds its own to (5% on the peak, 10%
per row; a recomputing run on autograd or FSDP2 1.0-1.3 on the peak: the plan adds the gradients
row to a peak the trace reaches before any gradient exists) and exits 1 when one is outside.

`--probe-table` reads the JSON of `apr train plan CONFIG --probe --trace --json` (scripts/gpu-check.sh
trace writes them on a GPU) and prints the rows of docs/performance.md's table: the plan, the trace
and the device's own measurement of the tensors, the allocator's reserve and the memory outside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
M50 = "configs/train/pretrain-50m.yaml"
RECOMPUTE_PEAK = (1.0, 1.3)  # tests/test_trace.py test_recompute_trace_matches_the_plans_rows

CASES: dict[str, dict] = {
    "350m": {"config": "configs/train/pretrain-350m-v2.yaml", "gpu": "h100", "over": {}},
    "7b-fsdp8": {"config": "configs/train/pretrain-350m-v2.yaml", "gpu": "h100", "world_size": 8, "over": {
        "model": {"architecture": LLAMA_7B},
        "data": {"batch_size": 4, "seq_len": 1024},
        "training": {"sharding": "full", "world_size": 8, "gradient_accumulation": 1}}},
}
for _name, _training in (("keep", {"execution": {"activations": "keep"}}),
                         ("recompute", {"execution": {"activations": "recompute"}}),
                         ("selective", {"execution": {"activations": "selective"}}),
                         ("standard", {"engine": "standard"})):
    CASES[f"50m-{_name}"] = {"config": M50, "over": {"training": _training}}
CASES.update({
    "50m-lora": {"config": M50, "over": {"model": {"lora": {"rank": 8}}}},
    "50m-stacking": {"config": M50, "over": {"model": {"stacking": {
        "stages": [{"blocks": 6, "steps": 5, "precision": "bf16"}, {"blocks": 12}], "earlier": "freeze",
        "trunk_lora": {"rank": 8}}}}},
    "50m-distill": {"config": M50, "teacher_layers": 24, "over": {"training": {"mode": "distill"}}},
    "50m-shard-grad-op8": {"config": M50, "world_size": 8,
                           "over": {"training": {"sharding": "shard_grad_op", "world_size": 8}}},
    "50m-hybrid2x4": {"config": M50, "world_size": 8, "nodes": 2,
                      "over": {"training": {"sharding": "hybrid", "world_size": 8, "nodes": 2}}},
    "50m-probe-trace": {"config": M50, "probe": True, "over": {}},
})
FULL = list(CASES)
# the small shape of tests/test_trace.py in the combinations its CI matrix leaves out
SMALL_CASES: dict[str, dict] = {
    "small-standard-selective": {"training": {"engine": "standard", "execution": {"activations": "selective"}}},
    "small-standard-keep-first-2": {"training": {"engine": "standard", "execution": {"activations": "keep_first:2"}}},
    "small-fsdp8-autograd": {"training": {"engine": "standard", "sharding": "full", "world_size": 8},
                             "world_size": 8},
    "small-fsdp8-walk-recompute": {"training": {"sharding": "full", "world_size": 8,
                                                "execution": {"activations": "recompute"}},
                                   "world_size": 8, "peak": RECOMPUTE_PEAK},
    "small-stacking-frozen-fp32-trunk": {"model": {"stacking": {
        "stages": [{"blocks": 2, "steps": 5}, {"blocks": 4}], "earlier": "freeze"}}},
    "small-distill-fp32": {"training": {"mode": "distill", "mixed_precision": "fp32"}, "teacher_layers": 8},
    # the sequence in one loss chunk (loss_chunk_size >= seq_len, as the default 256 is for seq_len 256):
    # the plan counts two chunks alive at the loss's peak where one exists
    "small-one-loss-chunk": {"training": {"loss_chunk_size": 256}},
}
for _name, _case in SMALL_CASES.items():
    CASES[_name] = {"small": True, "world_size": _case.get("world_size"), "peak": _case.get("peak"),
                    "teacher_layers": _case.get("teacher_layers"),
                    "over": {k: v for k, v in _case.items() if k in ("training", "model")}}


def _doc(case: dict, work: Path) -> dict:
    import yaml

    from apr.plan.examples import deep_merge

    if case.get("small"):
        from tests.test_trace import SMALL

        doc = deep_merge(SMALL, case["over"])
    else:
        doc = deep_merge(yaml.safe_load(open(ROOT / case["config"])), case["over"])
        doc["data"]["train"] = "stand-in/"
        for key in ("val", "tokenizer"):
            doc["data"].pop(key, None)
        doc["training"]["device"] = "cpu" if not case.get("gpu") else "cuda"
    if case.get("teacher_layers"):
        from apr.config.schema import AprConfig

        arch = AprConfig.model_validate(doc).model.architecture
        arch = arch.model_copy(update={"num_hidden_layers": case["teacher_layers"]})
        from tests.test_trace import teacher_folder

        doc = deep_merge(doc, {"training": {"distill": {"teacher": teacher_folder(work / "teacher", arch),
                                                        "phase1_steps": 1}}})
    return doc


def worker(case: dict) -> dict:
    """One case in this process: the plan's rows and the trace of rank 0."""
    from apr.config.schema import AprConfig
    from apr.memory.table import distill_rows, memory_table
    from apr.plan.memory import choose_execution
    from apr.steps.resolved import resolve
    from apr.trace import run_trace

    with tempfile.TemporaryDirectory() as tmp:
        config = AprConfig.model_validate(_doc(case, Path(tmp)))
        ws, nodes = case.get("world_size"), case.get("nodes", 1)
        laid_out = resolve(config, world_size=ws, nodes=nodes).config
        budget = 80 * 2**30 if case.get("gpu") == "h100" else None  # the catalogue's H100: 80 GiB
        execution = choose_execution(laid_out, budget).execution
        resolved = resolve(config, world_size=ws, nodes=nodes, execution=execution)
        rows = memory_table(resolved.config, execution=resolved.execution)
        if str(config.training.mode) == "distill":
            from apr.checkpoint.hf_import import source_architecture
            from apr.model.spec import param_count

            teacher = source_architecture(config.training.distill.teacher)
            rows += distill_rows(resolved.config, param_count(teacher), 0)
        t0 = time.perf_counter()
        out = run_trace(resolved, plan_rows=rows)
        out["wall_s"] = time.perf_counter() - t0
    return out


def probe_case(case: dict) -> dict:
    """`apr train plan CONFIG --probe --probe-steps 1 --trace --json` on stand-in data, as a user runs it."""
    cfg = ROOT / case["config"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    apr = [sys.executable, "-m", "apr"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*apr, "data", "synth", "--like", str(cfg), "--out", tmp, "--train-rows", "64"],
                       check=True, capture_output=True, env=env, timeout=600)
        t0 = time.perf_counter()
        proc = subprocess.run([*apr, "train", "plan", str(cfg), "training.max_steps=8", "training.warmup_steps=1",
                               "--probe", "--probe-steps", "1", "--trace", "--json"],
                              cwd=tmp, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    doc = json.loads(proc.stdout)
    out = doc["trace"]
    out["wall_s"] = time.perf_counter() - t0  # the plan, the probe's steps and the trace
    return out


def run(name: str) -> dict:
    case = CASES[name]
    if case.get("probe"):
        return probe_case(case)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(case)], capture_output=True,
                          text=True, cwd=ROOT, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(line[len("RESULT "):])


def outside_bounds(name: str, r: dict) -> list[str]:
    """What tests/test_trace.py would fail on: the peak outside its bound, a row outside 10%."""
    low, high = CASES[name].get("peak") or (0.95, 1.05)
    bad = [] if low <= r["ratio"] <= high else [f"peak {r['ratio']:.3f} outside {low}-{high}"]
    bad += [f"{x['name']} {x['ratio']:.3f}" for x in r["rows"] if x.get("ratio") and not 0.9 <= x["ratio"] <= 1.1]
    return bad


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def line(name: str, r: dict) -> str:
    rows = ", ".join(f"{x['name']} {x['ratio']:.2f}" for x in r["rows"] if x.get("ratio"))
    text = (f"{name}: plan/trace peak {r['ratio']:.3f} (plan {size(r['plan_peak_bytes'])}, traced "
            f"{size(r['peak_bytes'])}); rows {rows}; {r['wall_s']:.1f} s, RSS {r['rss'] / 2**20:.0f} MiB")
    probe = r.get("probe")
    if probe:
        tensors = next(x for x in probe["rows"] if x["name"] == "tensors")
        text += (f"; probe ({probe['device']}): tensors measured {size(tensors['measured_bytes'])}, "
                 f"trace/measured {tensors['trace_ratio']:.3f}")
    return text


def probe_table(paths: list[str]) -> None:
    """Markdown rows from `apr train plan --probe --trace --json` documents."""
    def cell(row: dict | None, key: str) -> str:
        value = (row or {}).get(key)
        return "-" if value is None else f"{value:.3f}" if "ratio" in key else size(value)

    print(f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"load {os.getloadavg()[0]:.2f} (this machine, now)")
    print("| case | device | peak plan / trace | tensors: plan / traced / measured (trace / measured) "
          "| allocator reserve: modelled / measured | outside the allocator: modelled / measured "
          "| device in use: plan / measured (plan / measured) |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        trace = json.loads(Path(path).read_text())["trace"]
        probe = trace.get("probe") or {}
        rows = {r["name"]: r for r in probe.get("rows", [])}
        t, a, c, d = (rows.get(k) for k in ("tensors", "allocator_slack", "cuda_context", "device"))
        print(f"| {Path(path).stem} | {probe.get('device_name') or probe.get('device')} | {trace['ratio']:.3f} "
              f"| {cell(t, 'plan_bytes')} / {cell(t, 'traced_bytes')} / {cell(t, 'measured_bytes')} "
              f"({cell(t, 'trace_ratio')}) | {cell(a, 'plan_bytes')} / {cell(a, 'measured_bytes')} "
              f"| {cell(c, 'plan_bytes')} / {cell(c, 'measured_bytes')} "
              f"| {cell(d, 'plan_bytes')} / {cell(d, 'measured_bytes')} ({cell(d, 'plan_ratio')}) |")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        print("RESULT " + json.dumps(worker(json.loads(argv[1]))))
        return 0
    if argv[:1] == ["--probe-table"]:
        probe_table(argv[1:])
        return 0
    check = "--check" in argv
    names = [a for a in argv if a != "--check"]
    names = [n for a in names for n in (list(SMALL_CASES) if a == "small" else [a])] or FULL
    failed = 0
    for name in names:
        r = run(name)
        if "error" in r:
            print(f"{name}: failed: {r['error']}")
            failed += 1
            continue
        print(line(name, r), flush=True)
        bad = outside_bounds(name, r) if check else []
        if bad:
            print(f"  OUTSIDE THE BOUNDS: {'; '.join(bad)}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
