"""training.reduction: canonical across 1, 2 and 4 gloo ranks, beyond what CI runs (CI's
tests/distributed/test_canonical.py runs 2 ranks and one process, DDP and FSDP2 full): 4 ranks x
accumulation 1 against one process x 4, the 4-rank run's step-4 checkpoint resumed on 2 ranks and on one
process, and the one-process run's resumed on 4 ranks, each compared tensor by tensor at step 8, and the validation
losses of the 4-rank and one-process runs (docs/performance.md, "Canonical reduction"). Prints how
many of the checkpoint's tensors differ (0: bitwise equal). ``--sharding`` picks the layout of the
ranks (none: DDP; full, hybrid, shard_grad_op: FSDP2; hybrid runs shard groups of 2 ranks,
``APR_SHARD_GROUP_SIZE=2``); ``--clip-mode`` the clipping.

    .venv/bin/python benchmarks/check_canonical_ranks.py [--sharding none] [--clip-mode global]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "train"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from run_helpers import config_doc, make_dataset  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from apr.checkpoint import parts  # noqa: E402
from tests.distributed.ranks import run_ranks, run_script  # noqa: E402

WORKER = REPO / "tests" / "train" / "run_worker.py"
COMMON = {"epochs": 1, "max_steps": 8, "save_interval": 4, "keep_last": 5, "eval_interval": 4, "eval_batches": 3,
          "engine": "standard", "reduction": "canonical", "grad_clip": 0.5}
LAYOUT: dict = {}  # --sharding and --clip-mode


def _doc(root: Path, out: str, accum: int) -> dict:
    return config_doc(root, data={"batch_size": 2}, optimizer={"lr": 1e-2, "min_lr": 1e-3},
                      training={**COMMON, **LAYOUT, "gradient_accumulation": accum, "output_dir": out})


def _launch(root: Path, doc: dict, name: str, ranks: int, resume: str | None = None) -> None:
    path = root / name
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "300", "APR_SHARD_GROUP_SIZE": "2"}
    proc = run_ranks(args, ranks, env, timeout=900) if ranks > 1 else run_script(args, env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _state(run_dir: Path, step: int) -> dict:
    """The checkpoint's whole tensors: one file, or a sharded run's parts joined."""
    stem = f"checkpoint-step-{step}"
    found = parts.parts_of(run_dir, stem)
    return parts.load(found, lambda name: True) if found else load_file(str(run_dir / f"{stem}.safetensors"))


def _differing(root: Path, a: str, b: str, step: int = 8) -> str:
    x, y = (_state(root / d, step) for d in (a, b))
    return f"{sum(not torch.equal(x[k], y[k]) for k in x)} of {len(x)} tensors differ"


def _resume_copy(root: Path, source: str, target: str, step: int = 4) -> None:
    (root / target).mkdir()
    for path in (root / source).glob(f"checkpoint-step-{step}.*"):  # the JSON and the weights (or their parts)
        shutil.copy(path, root / target)


def _val(root: Path, run: str) -> list:
    return json.loads((root / run / "training_state.json").read_text())["val_loss_history"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharding", default="none", choices=["none", "full", "hybrid", "shard_grad_op"])
    ap.add_argument("--clip-mode", default="global", choices=["global", "per_block", "adagc", "off"])
    args = ap.parse_args()
    LAYOUT.update(sharding=args.sharding, clip_mode=args.clip_mode)
    print(f"training.sharding {args.sharding}, clip_mode {args.clip_mode}")
    root = Path(tempfile.mkdtemp())
    make_dataset(root, train_rows=160)
    _launch(root, _doc(root, "four/", 1), "four.json", 4)
    _launch(root, _doc(root, "one/", 4), "one.json", 1)
    print("4 ranks x 1 against 1 process x 4:", _differing(root, "four", "one"))
    same = _val(root, "four") == _val(root, "one")
    print(f"validation losses at steps {[s for s, _ in _val(root, 'one')]}: {'bitwise equal' if same else 'DIFFER'}")
    _resume_copy(root, "four", "r2")
    _launch(root, _doc(root, "r2/", 1), "r2.json", 2, resume="latest")
    print("4 ranks, resumed from step 4 on 2 ranks:", _differing(root, "r2", "four"))
    _resume_copy(root, "four", "r1")
    _launch(root, _doc(root, "r1/", 1), "r1.json", 1, resume="latest")
    print("4 ranks, resumed from step 4 on 1 process:", _differing(root, "r1", "four"))
    _resume_copy(root, "one", "r4")
    _launch(root, _doc(root, "r4/", 4), "r4.json", 4, resume="latest")
    print("1 process, resumed from step 4 on 4 ranks:", _differing(root, "r4", "one"))


if __name__ == "__main__":
    main()
