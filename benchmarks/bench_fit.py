"""`apr train plan --fit` against a brute-force search on this CPU (issue 48; docs/performance.md,
"Fit against brute force").

For each config: ``apr train plan CONFIG --fit --json`` (a fresh ``APR_HOME``: no calibration of
these shapes yet) names the chosen layout and the candidates that fit; then every fitting candidate
is trained with ``apr train apply CONFIG KEY=VALUE...`` (its layout keys as settings, the same run
length), in turns over ``--rounds`` rounds. A layout's speed is its run's tokens over the apply
process's wall time (startup and compiling included, as the fit counts a run), the best of its
rounds (the least disturbed on a shared machine); the loop's rate (``tokens_seen / elapsed_s`` of
training_state.json, which starts after compiling) and the steady rate (the median of the logged
tokens/s after the first) are reported beside it. The number: the fit's choice over the best, by wall.

    .venv/bin/python benchmarks/bench_fit.py --workdir /tmp/apr-bench-fit --rounds 2

Data: the demo's corpus and tokenizer made with apr's own commands (scripts/demo.sh). Writes
``results.json`` in the workdir and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
APR = str(Path(sys.executable).with_name("apr"))
BASE = yaml.safe_load((REPO / "configs/train/demo-tiny.yaml").read_text())
# name -> changes to the demo config (seq_len 128: the shards' row length); each a global batch of 16
CONFIGS = {
    "demo-tiny": {"training": {"max_steps": 30, "warmup_steps": 3, "eval_interval": 0, "log_interval": 5}},
    "wide-3x192": {"model": {"architecture": {"hidden_size": 192, "num_hidden_layers": 3, "num_attention_heads": 6,
                                              "num_key_value_heads": 2, "intermediate_size": 512}},
                   "training": {"max_steps": 20, "warmup_steps": 2, "eval_interval": 0, "log_interval": 4}},
}


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def sh(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)


def prepare(work: Path, env: dict) -> None:
    if (work / "data" / "train").is_dir() and (work / "tok.json").is_file():
        return
    for args in ([APR, "data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--overwrite",
                  "--out", "tok.json"],
                 [APR, "data", "pretokenize", "--builtin", "stdlib", "--tokenizer", "tok.json", "--seq-len", "128",
                  "--val-fraction", "0.05", "--seed", "0", "--overwrite", "--out", "data"]):
        done = sh(args, env, work)
        if done.returncode:
            sys.exit(f"{' '.join(args)} failed:\n{done.stderr}")


def write_config(work: Path, name: str) -> Path:
    doc = merge(BASE, CONFIGS[name])
    doc["data"].update(train=str(work / "data/train"), val=str(work / "data/val"), tokenizer=str(work / "tok.json"))
    doc["training"]["output_dir"] = str(work / "runs" / name)
    doc["training"]["save_interval"] = 100_000
    doc["monitoring"] = {"tracking": {"experiment": "bench-fit"}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def layout_name(keys: dict) -> str:
    return (f"{keys['data.batch_size']}x{keys['training.gradient_accumulation']} "
            f"{keys['training.execution.activations']}{' compiled' if keys['training.execution.compile'] else ''}")


def train(config: Path, keys: dict, env: dict, work: Path) -> dict:
    """One apply of ``config`` at the layout ``keys``; its run's rates from training_state.json."""
    doc = yaml.safe_load(config.read_text())
    run_dir = Path(doc["training"]["output_dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    settings = [f"{k}={json.dumps(v)}" for k, v in keys.items() if k != "training.sharding"]
    t0 = time.monotonic()
    done = sh([APR, "train", "apply", str(config), *settings], env, work)
    wall = time.monotonic() - t0
    if done.returncode:
        return {"error": done.stderr[-2000:] or done.stdout[-2000:]}
    state = json.loads((run_dir / "training_state.json").read_text())
    steady = [v for _step, v in (state.get("tokens_per_s_history") or [])[1:]]
    return {"wall_tokens_per_s": state["tokens_seen"] / wall,
            "run_tokens_per_s": state["tokens_seen"] / state["elapsed_s"], "elapsed_s": state["elapsed_s"],
            "steady_tokens_per_s": statistics.median(steady) if steady else None, "wall_s": wall,
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/apr-bench-fit"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    shutil.rmtree(home, ignore_errors=True)  # no calibration of these shapes before the fit
    env = {**os.environ, "APR_HOME": str(home), "APR_EXTENDS_ANYWHERE": "1"}
    prepare(work, env)
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "python": platform.python_version()},
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": os.getloadavg()[0],
               "configs": {}}
    fits = {}
    for name in args.configs:
        config = write_config(work, name)
        planned = sh([APR, "train", "plan", str(config), "--fit", "--json"], env, work)
        if planned.returncode:
            sys.exit(f"plan --fit {name} failed:\n{planned.stdout[-2000:]}{planned.stderr[-2000:]}")
        fit = json.loads(planned.stdout)["fit"]
        fits[name] = (config, fit)
        candidates = {layout_name(c["keys"]): {"keys": c["keys"], "estimate": c["tokens_per_s"], "runs": []}
                      for c in fit["candidates"] if c["fits"]}
        results["configs"][name] = {"chosen": layout_name(fit["layout"]), "fit_seconds": fit["seconds"],
                                    "candidates": candidates}
    for r in range(args.rounds):  # in turns: a disturbance on the shared machine hits one round of each layout
        for name, (config, _fit) in fits.items():
            for label, cand in results["configs"][name]["candidates"].items():
                run = train(config, cand["keys"], env, work)
                cand["runs"].append(run)
                print(f"round {r + 1} {name} {label}: {run}", file=sys.stderr, flush=True)
    rows = ["| config | layout | fit's estimate (tokens/s) | measured wall tokens/s (best of rounds) | loop tokens/s |"
            " steady tokens/s | chosen |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, doc in results["configs"].items():
        for cand in doc["candidates"].values():
            ok = [run for run in cand["runs"] if "error" not in run]
            cand["best_wall_tokens_per_s"] = max((run["wall_tokens_per_s"] for run in ok), default=None)
            cand["best_run_tokens_per_s"] = max((run["run_tokens_per_s"] for run in ok), default=None)
            cand["best_steady_tokens_per_s"] = max((run["steady_tokens_per_s"] or 0 for run in ok), default=None)
        measured = {label: c["best_wall_tokens_per_s"] for label, c in doc["candidates"].items()
                    if c["best_wall_tokens_per_s"]}
        best = max(measured, key=measured.get)
        doc["best"], doc["ratio"] = best, measured.get(doc["chosen"], 0.0) / measured[best]
        for label, cand in sorted(doc["candidates"].items(), key=lambda kv: -(kv[1]["best_wall_tokens_per_s"] or 0)):
            rows.append(f"| {name} | {label} | {cand['estimate'] or 0:,.0f} | "
                        f"{cand['best_wall_tokens_per_s'] or 0:,.0f} | "
                        f"{cand['best_run_tokens_per_s'] or 0:,.0f} | {cand['best_steady_tokens_per_s'] or 0:,.0f} | "
                        f"{'fit' if label == doc['chosen'] else ''}"
                        f"{' best' if label == best else ''} |")
        print(f"{name}: fit chose {doc['chosen']}, the best measured (wall) is {best}: ratio {doc['ratio']:.3f}")
    results["load_end"] = os.getloadavg()[0]
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
