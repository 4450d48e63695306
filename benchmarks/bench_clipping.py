"""Clipping modes on the demo data: loss curves of global, per_block and adagc (docs/training.md,
"What each clipping mode does to training").

Builds the demo's corpus (the Python standard library's source, its own BPE tokenizer, seq 128)
in a temporary folder, then trains configs/train/demo-tiny.yaml once per clipping mode with the
same seed, data order and schedule, and prints the training loss every ``--log`` steps and the
validation loss at the end. Every mode runs the lean execution (one gradient workspace, full
recompute) unless ``--execution auto``: global clipping then pays its norm-only pre-pass walk,
the others do not.

    .venv/bin/python benchmarks/bench_clipping.py [--steps 200] [--log 20] [--grad-clip 1.0] [--lr 3e-3]
        [--modes global,per_block,adagc] [--execution lean|auto] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEP_RE = re.compile(r"^step\s+(\d+)/\d+\s+loss ([0-9.]+)\s+lr \S+\s+gnorm ([0-9.]+)")
VAL_RE = re.compile(r"val(?:idation)? loss ([0-9.]+)")


def prepare(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "APR_HOME": str(root / "home")}
    run = [sys.executable, "-m", "apr", "data"]
    subprocess.run([*run, "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--overwrite",
                    "--out", str(root / "tokenizer.json")], check=True, env=env, capture_output=True)
    subprocess.run([*run, "pretokenize", "--builtin", "stdlib", "--tokenizer", str(root / "tokenizer.json"),
                    "--seq-len", "128", "--val-fraction", "0.05", "--seed", "0", "--overwrite",
                    "--out", str(root / "data")], check=True, env=env, capture_output=True)


def train(root: Path, mode: str, args) -> dict:
    import yaml

    from apr.apply import run_apply

    doc = yaml.safe_load((REPO / "configs/train/demo-tiny.yaml").read_text())
    doc["data"].update(train=str(root / "data/train"), val=str(root / "data/val"),
                       tokenizer=str(root / "tokenizer.json"))
    doc["optimizer"]["lr"] = args.lr
    tr = doc["training"]
    tr.update(max_steps=args.steps, log_interval=args.log, eval_interval=args.steps, save_interval=10**6,
              output_dir=str(root / f"run-{mode}"), grad_clip=args.grad_clip, clip_mode=mode)
    if args.execution == "lean":
        tr["execution"] = {"activations": "recompute", "gradients": "workspace"}
    cfg = root / f"{mode}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    lines: list[str] = []
    t0 = time.perf_counter()
    result = run_apply(cfg, apr_home=root / "home", echo=lines.append, handle_signals=False)
    seconds = time.perf_counter() - t0
    curve = [(int(m[1]), float(m[2]), float(m[3])) for m in (STEP_RE.match(x) for x in lines) if m]
    return {"mode": mode, "status": result.status, "seconds": seconds, "curve": curve,
            "val_loss": result.val_loss, "first_val_loss": result.first_val_loss}


def render(res: dict) -> str:
    runs = res["runs"]
    out = [f"bench_clipping  {res['date']}  {res['steps']} steps, grad_clip {res['grad_clip']}, lr {res['lr']}, "
           f"execution {res['execution']}; load average before {res['loadavg_before']}", ""]
    head = f"{'step':>6}" + "".join(f"{r['mode'] + ' loss':>17}{'gnorm':>8}" for r in runs)
    out += [head, "-" * len(head)]
    for i, (step, *_rest) in enumerate(runs[0]["curve"]):
        out.append(f"{step:>6}" + "".join(f"{r['curve'][i][1]:>17.4f}{r['curve'][i][2]:>8.3f}" for r in runs))
    out.append("")
    for r in runs:
        out.append(f"{r['mode']:<10} val loss {r['first_val_loss']:.4f} -> {r['val_loss']:.4f}  "
                   f"({r['seconds']:.1f} s, {r['status']})")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--log", type=int, default=20)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["global", "per_block", "adagc"])
    ap.add_argument("--execution", choices=["lean", "auto"], default="lean")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="apr-bench-clip-") as tmp:
        root = Path(tmp)
        prepare(root)
        runs = [train(root, mode, args) for mode in args.modes]
    res = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "steps": args.steps,
           "grad_clip": args.grad_clip, "lr": args.lr, "execution": args.execution, "loadavg_before": load,
           "runs": runs}
    print(json.dumps(res, indent=2) if args.json else render(res))


if __name__ == "__main__":
    main()
