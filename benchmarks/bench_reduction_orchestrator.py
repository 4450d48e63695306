"""The cost of ``training.reduction: canonical`` against ``fast`` for an orchestrated run on 2 gloo ranks
of this CPU (docs/performance.md, "Canonical reduction", the orchestrator).

The same orchestrated config (decisions every --interval steps, 2 branches of --horizon steps each, a
nowcast, the validation loss as the reward) is applied end to end on --ranks ranks by
tests/train/run_worker.py, once with ``fast`` and once with ``canonical``, alternating for --rounds
rounds so both see the same machine. Per mode: the median wall time of a whole run (its processes'
start included) and of its training loop (``elapsed_s`` in training_state.json), the steps the
ranks trained (the run's, plus the losing branches'), and whether the two modes chose the same
winners. The memory canonical holds beyond fast is the plan's figure
(``apr.plan.reductionfacts.reduction_cost``: the orchestrator adds none of its own).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_reduction_orchestrator.py [--rounds 3] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "train"))
sys.path.insert(0, str(REPO))

from run_helpers import config_doc, make_dataset  # noqa: E402

from tests.distributed.ranks import run_ranks  # noqa: E402

WORKER = REPO / "tests" / "train" / "run_worker.py"


def _doc(root: Path, args, reduction: str, out: str) -> dict:
    arch = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 4 * args.hidden}
    training = {"epochs": 4, "max_steps": args.steps, "save_interval": args.steps, "keep_last": 1,
                "eval_interval": args.interval, "eval_batches": 4, "engine": "standard", "reduction": reduction,
                "grad_clip": 0.5, "gradient_accumulation": args.accum, "log_interval": args.steps,
                "output_dir": out,
                "orchestrator": {"enabled": True, "decision_interval": args.interval, "eval_horizon": args.horizon,
                                 "branches": 2, "nowcasting": {"enabled": True},
                                 "candidates": ["conservative_adamw", "aggressive_adamw", "spike_resistant"]}}
    return config_doc(root, model={"architecture": arch}, data={"batch_size": args.batch},
                      optimizer={"lr": 3e-3, "min_lr": 3e-4}, training=training)


def _run(root: Path, args, reduction: str, name: str) -> dict:
    path = root / f"{name}.json"
    path.write_text(json.dumps(_doc(root, args, reduction, f"{name}/")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "300", "APR_HOME": str(root / "home")}
    t0 = time.perf_counter()
    proc = run_ranks([str(WORKER), str(path)], args.ranks, env, timeout=1800)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = json.loads((root / name / "training_state.json").read_text())
    meta = json.loads((root / name / f"checkpoint-step-{args.steps}.json").read_text())
    history = meta["orchestrator"]["history"]
    branch_steps = sum(d["horizon"] * (len(d["branches"]) - 1) for d in history)
    return {"wall": wall, "loop": state["elapsed_s"], "steps": args.steps + branch_steps,
            "winners": [d["winner"] for d in history]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--ranks", 2), ("--accum", 2), ("--steps", 24), ("--interval", 6), ("--horizon", 3),
                          ("--hidden", 256), ("--layers", 4), ("--batch", 4), ("--rounds", 3)):
        ap.add_argument(flag, type=int, default=default)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    make_dataset(root, train_rows=640, val_rows=64)
    runs: dict[str, list[dict]] = {"fast": [], "canonical": []}
    for r in range(args.rounds):
        for mode in ("fast", "canonical") if r % 2 == 0 else ("canonical", "fast"):
            runs[mode].append(_run(root, args, mode, f"{mode}-{r}"))

    from apr.config.schema import AprConfig
    from apr.model.spec import trainable_param_count
    from apr.plan.reductionfacts import reduction_cost

    config = AprConfig.model_validate(_doc(root, args, "canonical", "x/"))
    params = trainable_param_count(config)
    cost = reduction_cost(config, 4 * params, args.ranks)
    print(f"{args.ranks} ranks x accumulation {args.accum}, {params / 1e6:.2f}M parameters, batch {args.batch} "
          f"x 16, {args.steps} steps, a decision every {args.interval} (2 branches of {args.horizon}), "
          f"{args.rounds} rounds")
    med = {}
    for mode, rs in runs.items():
        med[mode] = {k: statistics.median(r[k] for r in rs) for k in ("wall", "loop")}
        print(f"{mode:10s} run {med[mode]['wall']:7.1f} s   loop {med[mode]['loop']:7.1f} s   "
              f"{rs[0]['steps']} steps trained   {1e3 * med[mode]['loop'] / rs[0]['steps']:7.1f} ms/step   "
              f"winners {rs[0]['winners']}")
    print(f"canonical/fast: run {med['canonical']['wall'] / med['fast']['wall']:.3f}, "
          f"loop {med['canonical']['loop'] / med['fast']['loop']:.3f}; "
          f"canonical holds +{cost['extra_bytes'] / 2**20:.1f} MiB per rank, sends "
          f"{cost['gathered_bytes'] / 2**20:.1f} MiB a step")


if __name__ == "__main__":
    main()
