"""CPU thread policy: apr's default against each fixed policy and a plain loop of the same shape
(docs/performance.md, "CPU threads"; issue 53 item 1).

OpenMP reads OMP_WAIT_POLICY once, when torch loads, so every variant is its own process. Each round
starts one process per variant (the order rotated every round, so drift on a shared machine hits
all alike); a process builds its trainer, runs --warmup untimed steps and --steps timed ones, and
reports tokens/s (batch x seq / median step wall time) and its CPU time per step:

  apr default       apr's choice (apr/threads.py): threads = usable cores / ranks, the wait policy
                    from the load when the process starts
  apr ACTIVE        OMP_WAIT_POLICY=ACTIVE (waiting threads spin)
  apr PASSIVE       OMP_WAIT_POLICY=PASSIVE (waiting threads sleep; apr's default before issue 53)
  apr 1 thread      APR_CPU_THREADS=1
  apr torch's own   torch imported before apr: OpenMP's default wait, torch's thread count
  transformers      a plain transformers loop as a user writes it, torch's defaults: LlamaForCausalLM of
                    the same shape, full logits + F.cross_entropy, clip_grad_norm_, fused AdamW

apr runs its block walk with execution auto (bench_engine.py's "auto"), fp32. Same random
batches and seed in every process. The load average is printed with every process (`uptime`'s
first figure): compare rows only within one run. --hog N starts N busy-looping processes for the
whole run (the oversubscribed case).

    .venv/bin/python benchmarks/bench_threads.py [--rounds 3] [--steps 8] [--warmup 2] [--hog 0]
        [--hidden 128] [--layers 6] [--heads 4] [--intermediate 512] [--vocab 8192] [--seq 128] [--batch 8]
        [--only NAME,...] [--json] [--before TREE]

--before TREE adds "apr default (before)": the default of the apr in TREE (e.g. ``git archive`` of the
commit before a change to apr/threads.py), measured in the same rounds as the current one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {  # name -> environment changes (None: remove the variable)
    "apr default": {},
    "apr default (before)": {},  # --before TREE: the default of another checkout (a rule change's A/B)
    "apr ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "apr PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "apr 1 thread": {"APR_CPU_THREADS": "1"},
    "apr torch's own": {"BENCH_TORCH_FIRST": "1"},
    "transformers": {},
}
FIXED = ("apr ACTIVE", "apr PASSIVE", "apr 1 thread")  # the best of these is "the best policy"
CLEAN = ("OMP_WAIT_POLICY", "APR_OMP_WAIT_POLICY", "APR_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
         "BENCH_TORCH_FIRST")


def _shape_args(args) -> argparse.Namespace:
    return argparse.Namespace(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.heads,
                              intermediate=args.intermediate, vocab=args.vocab, seq=args.seq, batch=args.batch,
                              tied=False, precision="fp32", device="cpu", kernels="torch", loss_chunk=args.seq,
                              budget_gib=64.0)


def child(args) -> dict:
    """One variant in this process: build, warm up, time; returns the measurement."""
    load_start = os.getloadavg()[0]
    if os.environ.get("BENCH_TORCH_FIRST") or args.child == "transformers":
        import torch  # noqa: F401  (before apr: OpenMP starts with its own wait policy)
    from apr import threads  # sets OMP_WAIT_POLICY before torch loads, as apply does

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_engine
    import torch
    import torch.nn.functional as F

    shape = _shape_args(args)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
            for _ in range(args.warmup + args.steps)]
    if args.child == "transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(bench_engine.SEED)
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
            max_position_embeddings=args.seq, tie_word_embeddings=False))
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=bench_engine.LR, weight_decay=0.1, fused=True)

        def step(batch):
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
        policy = {"threads": torch.get_num_threads(), "wait": os.environ.get("OMP_WAIT_POLICY") or "OpenMP default"}
    else:
        config = bench_engine.make_config(shape, engine="interleaved", clip_mode="global")
        choice = threads.apply_thread_policy(config, 1)
        ap = bench_engine.build_apr(shape, torch.device("cpu"), "auto")

        def step(batch):
            return float(ap.step_fn(batch, False))
        policy = {"threads": torch.get_num_threads(), "wait": choice["omp_wait_policy"],
                  "wait_from": (threads.wait_decision() or {}).get("why") or choice.get("omp_wait_policy_from")}
    for batch in data[:args.warmup]:
        step(batch)
    walls, cpus, losses = [], [], []
    for batch in data[args.warmup:]:
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(batch))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    step_s = statistics.median(walls)
    return {"variant": args.child, "tokens_per_s": args.batch * args.seq / step_s, "step_s": step_s,
            "cpu_s": statistics.median(cpus), "first_loss": losses[0], "last_loss": losses[-1],
            "load_start": load_start, "load_end": os.getloadavg()[0], **policy}


def run_variant(name: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(VARIANTS[name])
    env["PYTHONPATH"] = str(args.before if name == "apr default (before)" else REPO)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, *_forward(args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        return {"variant": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _forward(args) -> list[str]:
    return [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in
            ("steps", "warmup", "hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch")]


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hog", type=int, default=0, help="busy-looping processes to run beside (oversubscription)")
    for name, default in (("hidden", 128), ("layers", 6), ("heads", 4), ("intermediate", 512), ("vocab", 8192),
                          ("seq", 128), ("batch", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--only", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--before", default=None, help="another checkout (e.g. a git archive of the previous commit) "
                   "whose apr default runs as the variant 'apr default (before)'")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    names = [n for n in VARIANTS if n in args.only and (args.before or n != "apr default (before)")]
    hogs = [_hog() for _ in range(args.hog)]
    results: dict[str, list[dict]] = {n: [] for n in names}
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                res = run_variant(name, args)
                results[name].append(res)
                print(f"  round {r + 1} {name}: " + (f"{res['tokens_per_s']:,.0f} tok/s, load {res['load_start']:.2f}"
                      f"; {res['wait']}" + (f" ({res['wait_from']})" if res.get("wait_from") else "")
                      if "error" not in res else res["error"]), file=sys.stderr, flush=True)
    finally:
        for h in hogs:
            h.kill()
    if args.json:
        print(json.dumps({"started": started, "hog": args.hog, "results": results}, indent=2))
        return 0
    print(f"{started}, {os.cpu_count()} CPUs, {args.hog} busy-loop processes beside; shape hidden {args.hidden}, "
          f"{args.layers} layers, {args.heads} heads, intermediate {args.intermediate}, vocab {args.vocab}, "
          f"batch {args.batch} x seq {args.seq}, fp32; {args.rounds} rounds x {args.steps} timed steps")
    med = {n: statistics.median(x["tokens_per_s"] for x in rs if "error" not in x) if any("error" not in x for x in rs)
           else None for n, rs in results.items()}
    best = max((med[n] for n in FIXED if med.get(n)), default=None)
    ref = med.get("transformers")
    print("| variant | tokens/s (median of rounds) | vs transformers | vs best fixed policy | threads | wait policy "
          "| load at start |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, rs in results.items():
        ok = [x for x in rs if "error" not in x]
        if not ok:
            print(f"| {n} | failed: {rs[0]['error']} | | | | | |")
            continue
        loads = [x["load_start"] for x in ok]
        print(f"| {n} | {med[n]:,.0f} | {med[n] / ref:.2f}x | " if ref else f"| {n} | {med[n]:,.0f} | - | ", end="")
        print(f"{med[n] / best:.2f}x | " if best else "- | ", end="")
        waits = [x["wait"] for x in ok]  # apr's default may choose differently in each round
        wait = ", ".join(f"{w} x{waits.count(w)}" for w in dict.fromkeys(waits)) if len(set(waits)) > 1 else waits[0]
        print(f"{ok[0]['threads']} | {wait} | {min(loads):.2f}-{max(loads):.2f} |")
    print("losses (first -> last step): " + "; ".join(f"{n} {rs[0]['first_loss']:.4f} -> {rs[0]['last_loss']:.4f}"
                                                     for n, rs in results.items() if "error" not in rs[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
