"""Training throughput of apr's engines against a plain PyTorch loop (docs/performance.md, "Training engine").

One model config, one run, the same random token batches and the same initial weights for every
approach:

  interleaved/per_block  apr InterleavedEngine, clip_mode per_block (one backward walk)
  interleaved/global     apr InterleavedEngine, clip_mode global (norm-only walk + stepping walk)
  standard               apr StandardEngine (full backward, clipping, torch.optim.AdamW)
  baseline               nanoGPT-style loop written here: apr's model object used directly,
                         full [batch, seq, vocab] logits + F.cross_entropy, loss.backward(),
                         clip_grad_norm_, torch.optim.AdamW (fused when available, else foreach)

Precision: fp32 on the CPU, bf16 autocast on CUDA (fp32 master weights everywhere). Warmup steps
are excluded; tokens/s = batch x seq / median step time (time.perf_counter, CUDA synchronized).

Memory: "grad MiB" is the peak of live ``.grad`` storage (distinct storages of the parameters'
``.grad``), sampled whenever a group's gradient is complete (the engines' probe) or after
``loss.backward()`` (baseline): the interleaved engine's shared workspace against the full
gradient set. On CUDA "peak MiB" is ``torch.cuda.max_memory_allocated`` over the timed steps with
only that approach alive (approaches then run one after the other); on the CPU approaches run
round-robin, one step each per round, so drift on a shared machine hits all of them alike
(``--sequential`` runs them one after another there too).

    .venv/bin/python benchmarks/bench_engine.py [--device cpu|cuda] [--hidden 256] [--layers 6]
        [--heads 4] [--kv-heads 4] [--intermediate 1024] [--vocab 8192] [--seq 256] [--batch 8]
        [--loss-chunk 256] [--warmup 2] [--steps 10] [--threads N] [--only NAME,...] [--sequential] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

APPROACHES = ("interleaved/per_block", "interleaved/global", "standard", "baseline")
# Step cost in forward-pass units F (apr/steps/strategy.py): forward F, backward 2F, recompute F.
COST_F = {"interleaved/per_block": 4, "interleaved/global": 7, "standard": 3, "baseline": 3}
LR = 3e-4
SEED = 1234


def make_config(args, *, engine: str, clip_mode: str):
    from apr.config.schema import AprConfig

    cuda = args.device == "cuda"
    return AprConfig.model_validate({
        "model": {"architecture": {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "intermediate_size": args.intermediate,
            "vocab_size": args.vocab, "max_position_embeddings": args.seq, "tie_word_embeddings": args.tied,
        }},
        "data": {"train": "unused/", "batch_size": args.batch, "seq_len": args.seq},
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "training": {
            "engine": engine, "clip_mode": clip_mode, "grad_clip": 1.0,
            "mixed_precision": "bf16" if cuda else "fp32", "device": args.device,
            "kernels": args.kernels if cuda else "torch", "loss_chunk_size": args.loss_chunk, "seed": SEED,
        },
    })


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def live_grad_bytes(params) -> int:
    storages: dict[int, int] = {}
    for p in params:
        if p.grad is not None:
            st = p.grad.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


@dataclass
class Approach:
    name: str
    note: str = ""
    times: list[float] = field(default_factory=list)
    grad_bytes: int = 0
    peak_bytes: int | None = None
    last_loss: float | None = None
    step_fn: object = None  # (batch, probe: bool) -> loss tensor
    free_fn: object = None


def build_apr(args, device: torch.device, name: str) -> Approach:
    from apr.train.engine import build_engine

    engine_kind, _, clip_mode = name.partition("/")
    config = make_config(args, engine=engine_kind, clip_mode=clip_mode or "global")
    engine = build_engine(config, device)
    params = list(engine.model.parameters())
    ap = Approach(name, note=f"kernels {engine.backend.name}; {engine.strategy.describe()}")

    def probe(_group: str) -> None:
        ap.grad_bytes = max(ap.grad_bytes, live_grad_bytes(params))

    def step(batch: torch.Tensor, measure: bool) -> torch.Tensor:
        engine.grad_probe = probe if measure else None
        return engine.train_step([batch], LR).loss

    def free() -> None:
        nonlocal engine, params
        del engine, params

    ap.step_fn, ap.free_fn = step, free
    return ap


def build_baseline(args, device: torch.device) -> Approach:
    """The nanoGPT-style loop: model(ids) -> full logits, F.cross_entropy, backward, clip, AdamW."""
    from apr.model import spec
    from apr.model.llama import build_model

    config = make_config(args, engine="standard", clip_mode="global")
    arch = config.model.architecture
    model = build_model(arch, SEED, device="cpu").to(device)  # the same initial weights as the engines
    named = dict(model.named_parameters())
    decay = {s.name for s in spec.param_specs(arch) if s.decay}  # the same decay rule as apr
    groups = [{"params": [p for n, p in named.items() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in named.items() if n not in decay], "weight_decay": 0.0}]
    kw = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8)
    try:  # fused where torch has it for this device (CUDA; the CPU since torch 2.4), else foreach
        opt, how = torch.optim.AdamW(groups, fused=True, **kw), "fused"
    except (RuntimeError, TypeError):
        opt, how = torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
    params = list(named.values())
    cast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
            else torch.autocast(device.type, enabled=False))
    ap = Approach("baseline", note=f"full logits + F.cross_entropy, clip_grad_norm_, torch AdamW ({how})")

    def step(batch: torch.Tensor, measure: bool) -> torch.Tensor:
        batch = batch.to(device, non_blocking=True)
        ids, targets = batch[:, :-1], batch[:, 1:]
        with cast:
            logits = model(ids)  # [batch, seq, vocab] float32
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        if measure:
            ap.grad_bytes = max(ap.grad_bytes, live_grad_bytes(params))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def free() -> None:
        nonlocal model, opt, params, named
        del model, opt, params, named

    ap.step_fn, ap.free_fn = step, free
    return ap


def build(args, device: torch.device, name: str) -> Approach:
    return build_baseline(args, device) if name == "baseline" else build_apr(args, device, name)


def timed_step(ap: Approach, batch: torch.Tensor, device: torch.device) -> None:
    sync(device)
    t0 = time.perf_counter()
    loss = ap.step_fn(batch, False)
    sync(device)
    ap.times.append(time.perf_counter() - t0)
    ap.last_loss = loss


def warm(ap: Approach, batches: list[torch.Tensor], device: torch.device) -> None:
    for i, batch in enumerate(batches):
        ap.step_fn(batch, i == len(batches) - 1)  # the last warmup step measures live gradients
    sync(device)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def run(args) -> dict:
    device = torch.device(args.device)
    load_before = loadavg()
    gen = torch.Generator().manual_seed(0)
    n = args.warmup + args.steps
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(n)]
    if device.type == "cuda":
        data = [b.to(device) for b in data]
    warm_data, timed_data = data[: args.warmup], data[args.warmup:]
    names = [a for a in APPROACHES if not args.only or a in args.only]
    approaches: list[Approach] = []
    cuda = device.type == "cuda"
    if cuda or args.sequential:  # one at a time: on CUDA the allocator's peak is then that approach's
        for name in names:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            ap = build(args, device, name)
            warm(ap, warm_data, device)
            for batch in timed_data:
                timed_step(ap, batch, device)
            if cuda:
                ap.peak_bytes = torch.cuda.max_memory_allocated(device)
            ap.last_loss = float(ap.last_loss)
            ap.free_fn()
            ap.step_fn = ap.free_fn = None
            approaches.append(ap)
            print(f"  {name}: done", file=sys.stderr, flush=True)
    else:  # round-robin: every approach sees the same machine conditions
        for name in names:
            ap = build(args, device, name)
            warm(ap, warm_data, device)
            approaches.append(ap)
            print(f"  {name}: built and warmed", file=sys.stderr, flush=True)
        for i, batch in enumerate(timed_data):
            for ap in approaches:
                timed_step(ap, batch, device)
            print(f"  round {i + 1}/{len(timed_data)}", file=sys.stderr, flush=True)
        for ap in approaches:
            ap.last_loss = float(ap.last_loss)

    from apr.model.spec import param_count

    arch = make_config(args, engine="standard", clip_mode="global").model.architecture
    tokens = args.batch * args.seq
    rows = []
    for ap in approaches:
        med = statistics.median(ap.times)
        rows.append({
            "approach": ap.name, "step_ms_median": med * 1e3, "step_ms_min": min(ap.times) * 1e3,
            "step_ms_max": max(ap.times) * 1e3, "step_ms_all": [round(t * 1e3, 1) for t in ap.times],
            "tokens_per_s": tokens / med,
            "tokens_per_s_best": tokens / min(ap.times), "grad_mib": ap.grad_bytes / 2**20,
            "peak_mib": None if ap.peak_bytes is None else ap.peak_bytes / 2**20, "cost_F": COST_F[ap.name],
            "last_loss": ap.last_loss, "note": ap.note,
        })
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"{cpu_name()}, {torch.get_num_threads()} torch threads"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine, "python": platform.python_version(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": loadavg(),
        "device": args.device, "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "vocab": args.vocab, "tied": args.tied,
                  "params": param_count(arch)},
        "batch": args.batch, "seq": args.seq, "loss_chunk": args.loss_chunk, "tokens_per_step": tokens,
        "warmup": args.warmup, "steps": args.steps, "results": rows,
        "full_logits_mib": tokens * args.vocab * 4 / 2**20,
        "chunk_logits_mib": args.batch * min(args.loss_chunk, args.seq) * args.vocab * 4 / 2**20,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(res: dict) -> str:
    m = res["model"]
    out = [
        f"bench_engine  {res['date']}  {res['machine']}  python {res['python']}  torch {res['torch']}",
        f"{res['cpu_count']} CPUs; load average (1/5/15 min) before {res['loadavg_before']}, "
        f"after {res['loadavg_after']}",
        f"model {m['params'] / 1e6:.2f}M params (hidden {m['hidden']}, {m['layers']} layers, heads "
        f"{m['heads']}/{m['kv_heads']} kv, intermediate {m['intermediate']}, vocab {m['vocab']}"
        f"{', tied' if m['tied'] else ''}); batch {res['batch']} x seq {res['seq']} = {res['tokens_per_step']} "
        f"tokens/step; {res['precision']} on {res['device']}; loss chunk {res['loss_chunk']}; "
        f"{res['warmup']} warmup + {res['steps']} timed steps (median)",
        "",
    ]
    rows = {r["approach"]: r for r in res["results"]}
    base, std = rows.get("baseline"), rows.get("standard")
    cuda = res["device"] == "cuda"
    head = (f"{'approach':<22} {'step ms':>8} {'best ms':>8} {'tokens/s':>9} {'x base':>7} {'x std':>6} "
            f"{'best tok/s':>10} {'x base':>7} {'cost':>5} {'grad MiB':>9} {'x base':>7}"
            + (f" {'peak MiB':>9} {'x base':>7}" if cuda else "") + f" {'loss':>8}")
    out += [head, "-" * len(head)]
    for r in res["results"]:
        def ratio(key, ref, r=r):
            return f"{r[key] / ref[key]:.2f}" if ref and ref.get(key) else "-"
        line = (f"{r['approach']:<22} {r['step_ms_median']:>8.0f} {r['step_ms_min']:>8.0f} "
                f"{r['tokens_per_s']:>9,.0f} {ratio('tokens_per_s', base):>7} {ratio('tokens_per_s', std):>6} "
                f"{r['tokens_per_s_best']:>10,.0f} {ratio('tokens_per_s_best', base):>7} {r['cost_F']:>4}F "
                f"{r['grad_mib']:>9.1f} {ratio('grad_mib', base):>7}")
        if cuda:
            line += f" {r['peak_mib']:>9.1f} {ratio('peak_mib', base):>7}"
        out.append(line + f" {r['last_loss']:>8.4f}")
    out += ["", "step ms / tokens/s: median timed step; best: the fastest timed step (least disturbed on a shared",
            "machine). x base / x std: ratio to the baseline / to apr's standard engine (tokens/s: >1 is faster;",
            "memory: <1 is less). cost: step cost in forward units F from apr/steps/strategy.py (expected",
            "tokens/s ratio to the baseline ~ 3 / cost if every F took the same time). loss: last timed",
            "step's training loss (same data, same initial weights: a sanity check that all do the same work).",
            f"Logits: the baseline materialises [batch, seq, vocab] float32 = {res['full_logits_mib']:.1f} MiB "
            f"(plus its gradient); apr's chunks hold {res['chunk_logits_mib']:.1f} MiB.", ""]
    out += [f"{r['approach']}: {r['note']}" for r in res["results"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tied", action="store_true", help="tie the embedding to the LM head")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--loss-chunk", type=int, default=256, help="apr's training.loss_chunk_size")
    ap.add_argument("--kernels", default="auto", help="apr's training.kernels on CUDA (the CPU always uses torch)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=None,
                    help=f"comma-separated subset of {','.join(APPROACHES)}")
    ap.add_argument("--sequential", action="store_true",
                    help="on the CPU too, run the approaches one after another instead of round-robin")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.only and set(args.only) - set(APPROACHES):
        ap.error(f"--only: unknown {sorted(set(args.only) - set(APPROACHES))}")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = run(args)
    print(json.dumps(res, indent=2) if args.json else render(res))


if __name__ == "__main__":
    main()
