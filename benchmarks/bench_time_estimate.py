"""The plan's time estimate against real runs (issue 39; docs/performance.md, "Time estimate against
actual runs").

For each run: ``apr train plan CONFIG --probe --json`` (the estimate: point and range), then
``apr train apply CONFIG`` timed as a user sees it (the process's wall time), with the 1-minute
load average at both moments. Three small CPU configs of the demo's family take turns, so each
shape sees its own probe and, from its second run on, the correction its finished runs taught the
calibration. Data: the demo's corpus and tokenizer made with apr's own commands (scripts/demo.sh).

    .venv/bin/python benchmarks/bench_time_estimate.py --runs 9 --workdir /tmp/apr-bench-time

Writes ``results.json`` in the workdir and prints a Markdown table. The registry is the workdir's
(``APR_HOME``), so earlier calibrations on this machine do not leak in.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
APR = str(Path(sys.executable).with_name("apr"))

BASE = yaml.safe_load((REPO / "configs/train/demo-tiny.yaml").read_text())
# name -> changes to the demo config (all seq_len 128: the shards' row length)
CONFIGS = {
    "demo-tiny-80": {"training": {"max_steps": 80, "eval_interval": 40}},
    "wide-3x192-40": {"model": {"architecture": {"hidden_size": 192, "num_hidden_layers": 3,
                                                 "num_attention_heads": 6, "num_key_value_heads": 2,
                                                 "intermediate_size": 512}},
                      "training": {"max_steps": 40, "eval_interval": 20}},
    "deep-4x96-b8-100": {"model": {"architecture": {"hidden_size": 96, "num_hidden_layers": 4,
                                                    "num_attention_heads": 3, "num_key_value_heads": 1,
                                                    "intermediate_size": 256}},
                         "data": {"batch_size": 8}, "training": {"max_steps": 100, "eval_interval": 50}},
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


def write_configs(work: Path) -> dict[str, Path]:
    paths = {}
    for name, over in CONFIGS.items():
        doc = merge(BASE, over)
        doc["data"].update(train=str(work / "data/train"), val=str(work / "data/val"), tokenizer=str(work / "tok.json"))
        doc["training"]["output_dir"] = str(work / "runs" / name)
        doc["monitoring"] = {"tracking": {"experiment": "bench-time"}}
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        paths[name] = path
    return paths


def one_run(i: int, name: str, cfg: Path, work: Path, env: dict, probe_steps: int) -> dict:
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    load_plan = os.getloadavg()[0]
    t0 = time.perf_counter()
    plan = sh([APR, "train", "plan", str(cfg), "--probe", "--probe-steps", str(probe_steps), "--json"], env, work)
    plan_s = time.perf_counter() - t0
    if plan.returncode:
        sys.exit(f"plan failed:\n{plan.stdout[-2000:]}\n{plan.stderr[-2000:]}")
    facts = json.loads(plan.stdout)["facts"]
    te = facts["time"]
    load_apply = os.getloadavg()[0]
    t0 = time.perf_counter()
    applied = sh([APR, "train", "apply", str(cfg)], env, work)
    actual = time.perf_counter() - t0
    if applied.returncode:
        sys.exit(f"apply failed:\n{applied.stdout[-2000:]}\n{applied.stderr[-2000:]}")
    load_end = os.getloadavg()[0]
    inside = te["low_seconds"] <= actual <= te["high_seconds"]
    row = {"run": i, "config": name, "estimate_s": te["estimated_seconds"], "low_s": te["low_seconds"],
           "high_s": te["high_seconds"], "actual_s": actual, "inside": inside,
           "point_error": actual / te["estimated_seconds"] - 1, "threads": te["assumes"]["threads"],
           "correction": te["assumes"]["correction_factor"], "load_plan": load_plan, "load_apply": load_apply,
           "load_end": load_end, "plan_s": plan_s, "calibration": facts["calibration"]["what"],
           "time_line": next((ln.strip() for ln in (applied.stdout + applied.stderr).splitlines()
                               if ln.strip().startswith("time:")), "")}
    print(f"{i:>2} {name:<18} est {row['estimate_s']:6.1f} s [{row['low_s']:6.1f}, {row['high_s']:6.1f}] actual "
          f"{actual:6.1f} s {'in ' if inside else 'OUT'} {row['point_error']:+.0%}  load {load_plan:.1f}/"
          f"{load_apply:.1f}/{load_end:.1f}  corr {row['correction']:.2f}", flush=True)
    return row


def replay(work: Path) -> None:
    """Recompute each finished run's estimate with the code as it is now, from the store rows
    recorded before that run (its probe included): a model change judged on the same runs."""
    os.environ["APR_HOME"] = str(work / "home")
    from apr.plan.build import build_plan
    from apr.plan.facts import calibrated_estimate, cpu_threads
    from apr.track import calibration

    by_key = {}
    for path in sorted(work.glob("*.yaml")):
        plan = build_plan(path)
        threads = cpu_threads(plan.config, 1)
        key = calibration.shape_key(calibration.shape(plan.config, plan.execution["policy"], threads["threads"]))
        by_key[key] = (path.stem, plan, threads)
    rows = calibration.list_calibrations()
    inside, errors = 0, []
    print("| run | config | estimate | range | actual | point error | inside |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, run in enumerate(r for r in rows if r["result"].get("source") == "run"):
        name, plan, threads = by_key[run["shape_key"]]
        prior = [r for r in rows if r["id"] < run["id"] and r["shape_key"] == run["shape_key"]]
        cal = calibration.summary(prior)
        facts = plan.facts
        te = calibrated_estimate(plan.config, facts["steps"]["total_tokens"], facts["model"]["flops_per_token"], cal, 1,
                                 "replay", facts["execution"]["cost_f"], threads, load_now=cal.get("load"))
        actual = run["result"]["actual_seconds"]
        ok = te["low_seconds"] <= actual <= te["high_seconds"]
        inside += ok
        errors.append(actual / te["estimated_seconds"] - 1)
        print(f"| {n + 1} | {name} | {te['estimated_seconds']:.1f} s | {te['low_seconds']:.1f}-"
              f"{te['high_seconds']:.1f} s | {actual:.1f} s | {errors[-1]:+.0%} | {'yes' if ok else '**no**'} |")
    print(f"\n{inside}/{len(errors)} inside; median |point error| "
          f"{sorted(abs(e) for e in errors)[len(errors) // 2]:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--probe-steps", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/apr-bench-time"))
    ap.add_argument("--keep-registry", action="store_true", help="keep the workdir's calibrations from before")
    ap.add_argument("--replay", action="store_true",
                    help="run nothing: recompute the estimates of the workdir's recorded runs with this code")
    args = ap.parse_args()
    work = args.workdir.resolve()
    if args.replay:
        replay(work)
        return
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "APR_HOME": str(work / "home"), "NO_COLOR": "1"}
    if not args.keep_registry:
        shutil.rmtree(work / "home", ignore_errors=True)
    prepare(work, env)
    paths = write_configs(work)
    names = list(paths)
    started = time.time()
    rows = [one_run(i + 1, names[i % len(names)], paths[names[i % len(names)]], work, env, args.probe_steps)
            for i in range(args.runs)]
    inside = sum(r["inside"] for r in rows)
    doc = {"machine": platform.node(), "cores": len(os.sched_getaffinity(0)), "started": started,
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(started)), "wall_s": time.time() - started,
           "inside": inside, "runs": len(rows), "rows": rows}
    (work / "results.json").write_text(json.dumps(doc, indent=2))
    print(f"\n{inside}/{len(rows)} inside the range; {doc['wall_s']:.0f} s in all\n")
    print("| # | config | estimate | range | actual | point error | inside | threads | correction "
          "| load at plan / apply / end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['config']} | {r['estimate_s']:.1f} s | {r['low_s']:.1f}-{r['high_s']:.1f} s | "
              f"{r['actual_s']:.1f} s | {r['point_error']:+.0%} | {'yes' if r['inside'] else '**no**'} | "
              f"{r['threads']} | {r['correction']:.2f} | {r['load_plan']:.1f} / {r['load_apply']:.1f} / "
              f"{r['load_end']:.1f} |")


if __name__ == "__main__":
    main()
