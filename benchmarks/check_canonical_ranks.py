"""training.reduction: canonical across 1, 2 and 4 gloo ranks, beyond what CI runs (CI's
tests/distributed/test_canonical.py runs 2 ranks and one process, DDP and FSDP2 full): 4 ranks x
accumulation 1 against one process x 4, the 4-rank run's step-4 checkpoint resumed on 2 ranks and on one
process, and the one-process run's resumed on 4 ranks, each compared tensor by tensor at step 8, and the validation
losses of the 4-rank and one-process runs (docs/performance.md, "Canonical reduction"). Prints how
many of the checkpoint's tensors differ (0: bitwise equal). ``--sharding`` picks the layout of the
ranks (none: DDP; full, hybrid, shard_grad_op: FSDP2; hybrid runs shard groups of 2 ranks,
``APR_SHARD_GROUP_SIZE=2``); ``--clip-mode`` the clipping. ``--feature orchestrator`` runs 12 steps
under ``training.orchestrator`` (decisions at steps 4 and 8, a nowcast at 8) and also compares the
decisions (every branch's validation loss, reward and training losses); ``--feature distill`` trains a
4-block teacher first, then distils a 2-block student through both phases (blocks ended by
convergence patience, autotune active) and also compares the distillation state (block ends, autotune).

    .venv/bin/python benchmarks/check_canonical_ranks.py [--sharding none] [--clip-mode global] \
        [--feature plain|orchestrator|distill]
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
LAYOUT: dict = {}  # --sharding and --clip-mode (and the feature's training keys)
FEATURE = ["plain"]  # --feature
FINAL = {"plain": 8, "orchestrator": 12, "distill": 8}  # the step the runs are compared at
ORCHESTRATOR = {"max_steps": 12, "orchestrator": {
    "enabled": True, "decision_interval": 4, "eval_horizon": 2, "branches": 2,
    "candidates": ["conservative_adamw", "aggressive_adamw", "spike_resistant"], "nowcasting": {"enabled": True}}}


def _distill(teacher: Path) -> dict:
    return {"mode": "distill", "distill": {"teacher": str(teacher), "phase1_steps": 3, "convergence_patience": 1,
                                           "init_from_teacher": True,
                                           "autotune": {"mode": "active", "plateau_patience": 1}}}


def _doc(root: Path, out: str, accum: int) -> dict:
    return config_doc(root, data={"batch_size": 2}, optimizer={"lr": 1e-2, "min_lr": 1e-3},
                      training={**COMMON, **LAYOUT, "gradient_accumulation": accum, "output_dir": out})


def _launch(root: Path, doc: dict, name: str, ranks: int, resume: str | None = None) -> None:
    path = root / name
    path.write_text(json.dumps(doc))
    args = [str(WORKER), str(path)] + ([resume] if resume else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "300", "APR_SHARD_GROUP_SIZE": "2"}
    proc = run_ranks(args, ranks, env, timeout=900) if ranks > 1 else run_script(args, env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _state(run_dir: Path, step: int) -> dict:
    """The checkpoint's whole tensors: one file, or a sharded run's parts joined."""
    stem = f"checkpoint-step-{step}"
    found = parts.parts_of(run_dir, stem)
    return parts.load(found, lambda name: True) if found else load_file(str(run_dir / f"{stem}.safetensors"))


def _differing(root: Path, a: str, b: str) -> str:
    step = FINAL[FEATURE[0]]
    x, y = (_state(root / d, step) for d in (a, b))
    said = f"{sum(not torch.equal(x[k], y[k]) for k in x)} of {len(x)} tensors differ at step {step}"
    meta = [json.loads((root / d / f"checkpoint-step-{step}.json").read_text()) for d in (a, b)]
    if LAYOUT.get("orchestrator"):
        same = meta[0]["orchestrator"]["history"] == meta[1]["orchestrator"]["history"]
        said += f"; {len(meta[0]['orchestrator']['history'])} decisions {'bitwise equal' if same else 'DIFFER'}"
    if LAYOUT.get("mode") == "distill":
        keys = ("autotune", "phase1", "distill_phase")
        same = all(meta[0]["engine"][k] == meta[1]["engine"][k] for k in keys)
        said += f"; distillation state {'equal' if same else 'DIFFERS'}"
    return said


def _resume_copy(root: Path, source: str, target: str, step: int = 4) -> None:
    (root / target).mkdir()
    for path in (root / source).glob(f"checkpoint-step-{step}.*"):  # the JSON and the weights (or their parts)
        shutil.copy(path, root / target)
    if (root / source / ".apr" / "nowcast").is_dir():  # the orchestrator's nowcast points (each rank's on shards)
        shutil.copytree(root / source / ".apr" / "nowcast", root / target / ".apr" / "nowcast")


def _val(root: Path, run: str) -> list:
    return json.loads((root / run / "training_state.json").read_text())["val_loss_history"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharding", default="none", choices=["none", "full", "hybrid", "shard_grad_op"])
    ap.add_argument("--clip-mode", default="global", choices=["global", "per_block", "adagc", "off"])
    ap.add_argument("--feature", default="plain", choices=sorted(FINAL))
    args = ap.parse_args()
    LAYOUT.update(sharding=args.sharding, clip_mode=args.clip_mode)
    FEATURE[0] = args.feature
    print(f"training.sharding {args.sharding}, clip_mode {args.clip_mode}, {args.feature}")
    root = Path(tempfile.mkdtemp())
    make_dataset(root, train_rows=160)
    if args.feature == "orchestrator":
        LAYOUT.update(ORCHESTRATOR)
    elif args.feature == "distill":
        teacher = config_doc(root, model={"architecture": {"num_hidden_layers": 4}},
                             training={"max_steps": 2, "save_interval": 2, "eval_interval": 0, "output_dir": "base/"})
        _launch(root, teacher, "base.json", 1)
        LAYOUT.update(_distill(root / "base"))
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
    if args.feature == "orchestrator":  # after the first decision: its nowcast point read on another layout
        _resume_copy(root, "four", "r2b", step=8)
        _launch(root, _doc(root, "r2b/", 1), "r2b.json", 2, resume="latest")
        print("4 ranks, resumed from step 8 on 2 ranks:", _differing(root, "r2b", "four"))
        _resume_copy(root, "one", "r4b", step=8)
        _launch(root, _doc(root, "r4b/", 4), "r4b.json", 4, resume="latest")
        print("1 process, resumed from step 8 on 4 ranks:", _differing(root, "r4b", "one"))


if __name__ == "__main__":
    main()
