"""The storage plan against real checkpoints (docs/performance.md, "Storage plan").

Builds a config's trainer state on the CPU (fp32 weights and both AdamW moments), saves it with
CheckpointManager at step 1 and at the run's last step, and prints each file's size beside the
plan's prediction (apr.checkpoint.manager.weights_file_bytes, exact by construction), the JSON
sidecar's size against the plan's 64 KiB bound, and the measured write speed (SHA-256 and fsync
included) beside the plan's assumed 500 MB/s; plain torch.save + fsync of the same tensors is the
baseline.

    .venv/bin/python benchmarks/bench_storage_plan.py [--config configs/train/pretrain-50m.yaml] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from apr.steps.resolved import resolve as plan_of

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs/train/pretrain-50m.yaml"))
    p.add_argument("--out", default=None, help="Folder to write in (default: a temporary one).")
    args = p.parse_args()

    import torch

    from apr.checkpoint.manager import CheckpointManager, TrainState, weights_file_bytes
    from apr.config.loader import load_config
    from apr.plan.storage import SIDECAR_BYTES, WRITE_BYTES_PER_S
    from apr.train.build import build_engine

    config = load_config(args.config, settings=["training.device=cpu", "training.mixed_precision=fp32"]).config
    engine = build_engine(plan_of(config), torch.device("cpu"))
    tensors = engine.train_state_tensors()
    base = Path(args.out or tempfile.mkdtemp(prefix="bench-storage-"))
    print(f"# bench_storage_plan {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%MZ} {platform.node()} "
          f"load {os.getloadavg()[0]:.1f}; {Path(args.config).name}; folder {base}")
    print(f"{'save':<22} {'file (B)':>12} {'plan (B)':>12} {'json (B)':>9} {'s':>6} {'MB/s':>6}")
    last = config.training.max_steps or 1
    for step in (1, last):
        folder = base / f"step-{step}"
        mgr = CheckpointManager(folder, config)
        t0 = time.perf_counter()
        mgr.save(TrainState(step=step, tensors=tensors, meta={"epoch": 0}))
        dt = time.perf_counter() - t0
        size = (folder / f"checkpoint-step-{step}.safetensors").stat().st_size
        sidecar = (folder / f"checkpoint-step-{step}.json").stat().st_size
        print(f"{f'CheckpointManager @{step}':<22} {size:>12} {weights_file_bytes(config, step):>12} "
              f"{sidecar:>9} {dt:>6.2f} {size / dt / 1e6:>6.0f}")
    path = base / "state.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    print(f"{'torch.save (baseline)':<22} {path.stat().st_size:>12} {'-':>12} {'-':>9} {dt:>6.2f} "
          f"{path.stat().st_size / dt / 1e6:>6.0f}")
    print(f"plan: sidecar bound {SIDECAR_BYTES} B, assumed write speed {WRITE_BYTES_PER_S / 1e6:.0f} MB/s")
    if args.out is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
