"""How long a checkpoint blocks training (docs/performance.md, "Background checkpoints").

The trainer's state of a config (fp32 weights and both AdamW moments, as the interleaved engine
holds them) is saved three ways, each timed from the call to when training could go on:

  sync        CheckpointManager.save: safetensors + JSON written and fsynced before it returns
  background  CheckpointManager.save(background=True): the host snapshot only; the write's own
              time (until ``wait`` returns) is shown beside it
  torch.save  the plain-PyTorch baseline: torch.save of the same tensors to one file (+ fsync)

Each is repeated ``--repeats`` times into a fresh folder on the same disk; the median is shown.

    .venv/bin/python benchmarks/bench_checkpoint.py [--config configs/train/pretrain-50m.yaml] [--repeats 3]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="Folder to write in (default: a temporary one).")
    args = p.parse_args()

    import torch

    from apr.checkpoint.manager import CheckpointManager, TrainState
    from apr.config.loader import load_config
    from apr.train.build import build_engine

    config = load_config(args.config, settings=["training.device=cpu", "training.mixed_precision=fp32"]).config
    engine = build_engine(plan_of(config), torch.device("cpu"))
    tensors = engine.train_state_tensors()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    base = Path(args.out or tempfile.mkdtemp(prefix="bench-ckpt-"))
    times: dict[str, list[float]] = {"sync": [], "background": [], "background write": [], "torch.save": []}
    for r in range(args.repeats):
        for name in ("sync", "background", "torch.save"):
            folder = base / f"{name.replace('.', '_')}-{r}"
            folder.mkdir(parents=True)
            t0 = time.perf_counter()
            if name == "torch.save":
                path = folder / "state.pt"
                with open(path, "wb") as f:
                    torch.save(tensors, f)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                mgr = CheckpointManager(folder, config)
                mgr.save(TrainState(step=1, tensors=tensors, meta={"epoch": 0}), background=name == "background")
            times[name].append(time.perf_counter() - t0)
            if name == "background":
                mgr.wait()
                times["background write"].append(time.perf_counter() - t0)
            shutil.rmtree(folder)
    print(f"# bench_checkpoint {datetime.date.today()} {platform.node()} load {os.getloadavg()[0]:.1f}; "
          f"{Path(args.config).name}: {size / 2**20:.0f} MiB of weights + AdamW moments; folder {base}")
    base_t = statistics.median(times["torch.save"])
    print(f"{'save':<18} {'blocks training (s)':>20} {'vs torch.save':>14}")
    for name, ts in times.items():
        med = statistics.median(ts)
        label = f"{med:.3f}" if name != "background write" else f"({med:.3f} until on disk)"
        print(f"{name:<18} {label:>20} {med / base_t:>14.3f}")
    if args.out is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
