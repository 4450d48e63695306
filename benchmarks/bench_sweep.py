"""What `apr sweep run` costs over its trials (docs/performance.md, "Sweeps").

Makes the demo's data (`make demo`'s tokenizer and shards of Python's standard library) in a work
folder, runs a ``--trials``-trial random sweep of configs/train/demo-tiny.yaml (optimizer.lr
log-uniform in [1e-3, 1e-2], training.warmup_steps in {2, 5, 8}, training.max_steps fixed at
``--max-steps``), then runs each of its trials again one by one with `apr train apply` and the
trial's settings, and prints the sweep's wall time, the sum of the one-by-one runs and their ratio
(the target: at most 1.1). Both sides pay the same process start-up per trial; the sweep adds its
own start, the Optuna storage and each trial's plan.

    .venv/bin/python benchmarks/bench_sweep.py [--trials 12] [--max-steps 200] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "train" / "demo-tiny.yaml"


def apr(*args: str, cwd: Path, env: dict) -> float:
    """Run one apr command; its wall time in seconds."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "apr", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"apr {' '.join(args)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - start


def make_data(work: Path, env: dict) -> None:
    """The demo's corpus (scripts/demo.sh steps 1 and 2) under work/demo-run/, as the config names it."""
    out = work / "demo-run"
    if (out / "data").is_dir():
        return
    apr("data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--overwrite", "--out",
        str(out / "tokenizer.json"), cwd=work, env=env)
    apr("data", "pretokenize", "--builtin", "stdlib", "--tokenizer", str(out / "tokenizer.json"), "--seq-len", "128",
        "--val-fraction", "0.05", "--seed", "0", "--overwrite", "--out", str(out / "data"), cwd=work, env=env)


def sweep_file(work: Path, trials: int, max_steps: int) -> Path:
    path = work / "bench-sweep.yaml"
    path.write_text(f"""name: bench-sweep
config: {CONFIG}
method: random
run_cap: {trials}
metric: {{name: val_loss, goal: minimize}}
parameters:
  optimizer.lr: {{distribution: log_uniform_values, min: 0.001, max: 0.01}}
  training.warmup_steps: {{values: [2, 5, 8]}}
  training.max_steps: {{value: {max_steps}}}
""")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--max-steps", type=int, default=200, help="steps per trial (the demo's own: 200)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "APR_HOME": str(work / "home"), "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    make_data(work, env)
    sweep = sweep_file(work, args.trials, args.max_steps)

    sweep_s = apr("sweep", "run", str(sweep), "--dir", str(work / "sweep"), cwd=work, env=env)
    status = subprocess.run([sys.executable, "-m", "apr", "sweep", "status", str(sweep), "--dir", str(work / "sweep"),
                             "--json"], cwd=work, env=env, capture_output=True, text=True, check=True)
    trials = json.loads(status.stdout)["trials"]
    one_by_one = []
    for t in trials:
        if t["state"] != "finished":  # an invalid trial costs the sweep a plan and the loop nothing
            continue
        settings = [f"{k}={json.dumps(v)}" for k, v in t["params"].items()]
        out = work / "one-by-one" / f"{t['number']:04d}"
        one_by_one.append(apr("train", "apply", str(CONFIG), *settings, f"training.output_dir={json.dumps(str(out))}",
                              cwd=work, env=env))
    result = {"trials": len(trials), "finished": sum(t["state"] == "finished" for t in trials),
              "max_steps": args.max_steps, "sweep_s": sweep_s, "one_by_one_s": sum(one_by_one),
              "ratio": sweep_s / sum(one_by_one), "per_trial_s": one_by_one,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "date": datetime.date.today().isoformat()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['trials']} trials ({result['finished']} finished) of {args.max_steps} steps, {result['machine']}")
    print(f"  apr sweep run:            {sweep_s:8.1f} s")
    print(f"  apr train apply x {len(trials):<3}:    {sum(one_by_one):8.1f} s  "
          f"(per trial {min(one_by_one):.1f}-{max(one_by_one):.1f} s)")
    print(f"  ratio sweep / one by one: {result['ratio']:8.3f}  (target <= 1.1)")


if __name__ == "__main__":
    main()
