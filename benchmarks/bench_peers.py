"""apr against the trainers users would pick instead (issue 40; docs/performance.md, "Peers").

Engine level, one process, bench_engine.py's shape and method: a LLaMA of 10.5M parameters (hidden
256, 6 layers, 4 heads, intermediate 1024, vocab 8192, untied), batch 8 x seq 256, fp32, one torch
thread, the same random token batches and the same initial weights (apr's model, copied into each
peer's layout), CPU time per step, round-robin (one step of each approach per round):

  baseline        bench_engine's plain loop: apr's model, full logits + F.cross_entropy,
                  clip_grad_norm_, torch AdamW (fused)
  apr auto        apr's block walk, execution auto against a roomy budget (bench_engine);
                  `apr+compile` with training.execution.compile: true
  litgpt          litgpt's GPT (LLaMA config) and the step of `litgpt pretrain`'s fit loop:
                  model(ids), litgpt.utils.chunked_cross_entropy, clip_grad_norm_, optimizer step
                  (torch AdamW, foreach: pretrain asks for fused only on CUDA), zero_grad;
                  `litgpt+compile` wraps the model in torch.compile as pretrain does
  torchtitan      torchtitan's Llama3Model (its own model code, no activation checkpointing,
                  unfused q/k/v, RoPE theta 10000) with the loss and step of its trainer (cross-entropy
                  over the full logits, clip_grad_norm_, fused AdamW). torchtitan's Trainer cannot
                  start on a CPU (it sets a CUDA device), so only its model code is timed, in this
                  step loop. Its RoPE pairs dimensions (interleaved) where Hugging Face rotates
                  halves, so q/k are permuted with torchtitan's own state-dict adapter. torchtitan
                  0.3.0 refuses sdpa for language models and its flex attention has no backward on
                  a CPU (torch 2.13), so it is skipped with that reason. This script is the CPU
                  table; benchmarks/bench_peers_cuda.py builds the same approaches on a GPU (the
                  350M bf16 table) and scripts/gpu-check.sh runs it (stage peers).

Step 1's loss of every approach is checked against the baseline's (same weights, same batch):
printed as "dloss@1" and required below 1e-4 relative (chunked cross-entropies round differently).

End to end (--e2e), the whole commands as a user times them, one torch thread each
(OMP_NUM_THREADS=1, APR_CPU_THREADS=1), the same token array (Parquet shards for apr, a .npy
through benchmarks/peers_litgpt_data.py for litgpt), unshuffled, the same initial weights (apr's,
converted and given to litgpt as --initial_checkpoint_dir), log_interval --e2e-log-interval for both,
no evaluation, the final checkpoint written by both:

  apr train apply CONFIG                 (python -m apr; --e2e-apr-compile adds a run with
                                          training.execution.compile: true)
  litgpt pretrain --config CONFIG        (python -m litgpt; torch.compile, chunked cross-entropy,
                                          its 2-batch sanity validation, a final checkpoint)

After one untimed run of each (the token cache and inductor's compile cache warm, as on a user's
second run), each command runs at two lengths (--e2e-steps, e.g. 4 and 12 steps), alternating apr
and litgpt, --e2e-repeats times. The per-step cost is the marginal one, (CPU(long) - CPU(short)) / (steps
difference), child process CPU time (resource.getrusage RUSAGE_CHILDREN), so start-up (imports,
planning, torch.compile) cancels; the fixed cost is printed apart (the short run's CPU minus its
steps at the marginal cost). Step 1's loss of both commands (apr's printed line, litgpt's CSV log)
must agree to 1e-3 (apr prints 4 decimals).

A peer that is not installed (pip install -e '.[bench]') or fails to build is skipped, with the
reason printed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_peers.py [--steps 8] [--warmup 2]
        [--only baseline,apr,apr+compile,litgpt,litgpt+compile,torchtitan] [--e2e] [--no-engine]
        [--e2e-steps 4,12] [--e2e-repeats 1] [--e2e-log-interval 1] [--e2e-apr-compile] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_engine  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

APPROACHES = ("baseline", "apr", "apr+compile", "litgpt", "litgpt+compile", "torchtitan")
DEFAULT = ("baseline", "apr", "litgpt", "torchtitan")
LR = bench_engine.LR
# torchtitan 0.3.0 refuses sdpa for language models ("use flex, flex_flash, or varlen"); flex runs on a CPU
TITAN_ATTENTION = "flex"


class Skip(Exception):
    """A peer that cannot run here; the reason is printed."""


def shape_args(args) -> argparse.Namespace:
    """bench_engine's arguments for this shape (the CPU fp32 table unless ``args`` names a device,
    KV heads or a precision: benchmarks/bench_peers_cuda.py)."""
    device = _device(args)
    return argparse.Namespace(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=_kv_heads(args),
                              intermediate=args.intermediate, vocab=args.vocab, seq=args.seq, batch=args.batch,
                              tied=False, precision=getattr(args, "precision", None), device=device.type,
                              kernels="auto" if device.type == "cuda" else "torch", loss_chunk=args.seq,
                              budget_gib=float(getattr(args, "budget_gib", 64.0)))


def _device(args) -> torch.device:
    return torch.device(getattr(args, "device", "cpu"))


def _kv_heads(args) -> int:
    return getattr(args, "kv_heads", None) or args.heads


def _autocast(args):
    """What each peer's forward runs under: bench_engine's baseline rule (fp32 on the CPU, bf16
    autocast on CUDA, or --precision) over fp32 weights, as litgpt's "bf16-mixed" and torchtitan's
    mixed-precision policy keep fp32 masters."""
    device = _device(args)
    low = getattr(args, "precision", None) or ("bf16" if device.type == "cuda" else "fp32")
    if low == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[low])


def apr_weights(args) -> tuple[dict, object]:
    """apr's initial weights (Hugging Face names) and its architecture: what every approach starts from."""
    from apr.model.llama import build_model

    cfg = bench_engine.make_config(shape_args(args), engine="standard", clip_mode="global")
    arch = cfg.model.architecture
    return build_model(arch, bench_engine.SEED, device="cpu").state_dict(), arch


def build_litgpt(args, weights: dict, arch, compiled: bool) -> bench_engine.Approach:
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
        from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
        from litgpt.utils import chunked_cross_entropy
    except ImportError as err:
        raise Skip(f"litgpt is not installed ({err}); pip install -e '.[bench]'") from None
    config = _litgpt_config(Config, args, arch)
    model = GPT(config)
    state: dict = {}
    copy_weights_hf_llama(config, {}, state, dict(weights))
    model.load_state_dict(state, strict=True)
    cuda = _device(args).type == "cuda"
    model.to(_device(args))
    # pretrain asks for a fused AdamW on CUDA, foreach elsewhere
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            **({"fused": True} if cuda else {"foreach": True}))
    forward = torch.compile(model) if compiled else model
    ap = bench_engine.Approach("litgpt+compile" if compiled else "litgpt",
                               note=f"litgpt GPT, chunked_cross_entropy (128), clip_grad_norm_, AdamW "
                                    f"({'fused, as pretrain on CUDA' if cuda else 'foreach, as pretrain on a CPU'})"
                                    f"{'; torch.compile(model)' if compiled else ''}")

    def step(batch: torch.Tensor, measure: bool) -> torch.Tensor:
        ids, targets = batch[:, :-1], batch[:, 1:]
        with _autocast(args):
            logits = forward(ids)
        loss = chunked_cross_entropy(logits, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    ap.step_fn, ap.free_fn = step, lambda: None
    return ap


def _import_torchtitan():
    """torchtitan 0.3.0's model package imports its MoE expert-parallel kernels, which need triton (a
    GPU compiler, absent from a CPU install); the dense Llama uses none of them, so that one module is
    stubbed while the model code is imported."""
    name = "torchtitan.distributed.minimal_async_ep"
    stubbed = name not in sys.modules
    if stubbed:
        try:
            import triton  # noqa: F401
            stubbed = False
        except ImportError:
            stub = types.ModuleType(name)
            for attr in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config",
                         "MinimalAsyncEPDispatchMetadata"):
                setattr(stub, attr, None)
            sys.modules[name] = stub
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE as RoPE  # the RoPE llama3 uses (pairs, complex)

    return llama3, RoPE


def build_torchtitan(args, weights: dict, arch) -> bench_engine.Approach:
    try:
        llama3, RoPE = _import_torchtitan()
    except ImportError as err:
        raise Skip(f"torchtitan is not importable here ({err}); pip install -e '.[bench]'") from None
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    dim = args.hidden
    try:
        rope = RoPE.Config(dim=dim // args.heads, max_seq_len=args.seq, theta=arch.rope_theta)
        layers = llama3._build_llama3_layers(n_layers=args.layers, dim=dim, n_heads=args.heads,
                                             n_kv_heads=_kv_heads(args),
                                             hidden_dim=args.intermediate, rope=rope, fuse_qkv=False,
                                             attn_backend=TITAN_ATTENTION)
        config = llama3.Llama3Model.Config(
            dim=dim, vocab_size=args.vocab,
            tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=dim),
            norm=RMSNorm.Config(normalized_shape=dim, eps=arch.rms_norm_eps),
            lm_head=Linear.Config(in_features=dim, out_features=args.vocab), layers=layers)
        model = config.build()
        adapter = llama3.Llama3StateDictAdapter(config, None)
        model.load_state_dict(adapter.from_hf(dict(weights)), strict=True)
    except Exception as err:  # torchtitan's config API moves between releases
        raise Skip(f"torchtitan's Llama3Model could not be built from this shape: {type(err).__name__}: {err}") \
            from None
    model.to(_device(args))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ap = bench_engine.Approach("torchtitan", note="torchtitan Llama3Model (model code only: its Trainer needs "
                                                  "CUDA), full logits + cross_entropy, clip_grad_norm_, AdamW (fused)")

    positions = torch.arange(args.seq, device=_device(args)).expand(args.batch, args.seq)  # one document per row

    def step(batch: torch.Tensor, measure: bool) -> torch.Tensor:
        ids, targets = batch[:, :-1], batch[:, 1:]
        # the trainer's post_dataloading_process: flex attention's block mask from the positions, every step
        with _autocast(args):
            logits = model(ids, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    ap.step_fn, ap.free_fn = step, lambda: None
    return ap


def build(args, name: str, weights: dict, arch) -> bench_engine.Approach:
    device = _device(args)
    if name == "baseline":
        return bench_engine.build_baseline(shape_args(args), device)
    if name in ("apr", "apr+compile"):  # apr+compile: training.execution.compile: true (per-block torch.compile)
        ap = bench_engine.build_apr(shape_args(args), device, "auto" if name == "apr" else "auto+compile")
        ap.name = name
        return ap
    if name.startswith("litgpt"):
        return build_litgpt(args, weights, arch, compiled=name == "litgpt+compile")
    return build_torchtitan(args, weights, arch)


# --profile: aten ops grouped by what they do (the first category whose key is in the op's name)
CATEGORIES = (
    ("matmul", ("mm", "matmul", "linear")),
    ("attention", ("scaled_dot_product", "flash_attention", "flex")),
    ("cross-entropy", ("log_softmax", "nll_loss", "cross_entropy", "softmax_backward", "logsumexp")),
    ("rms_norm", ("rms_norm",)),
    ("optimizer", ("adam", "_foreach", "vector_norm", "clip")),
    ("copies", ("copy_", "clone", "contiguous", "cat", "stack", "index", "embedding", "empty", "zero_", "fill_")),
    ("elementwise", ("mul", "add", "sub", "div", "silu", "rsqrt", "pow", "mean", "sum", "neg", "exp", "sigmoid",
                     "where", "sqrt", "lerp", "maximum", "clamp", "sin", "cos")),
)


def _category(name: str) -> str:
    bare = name.removeprefix("aten::")
    return next((cat for cat, keys in CATEGORIES if any(k in bare for k in keys)), "other")


def profile_approaches(approaches: list, data: list, rounds: int = 2) -> dict:
    """torch.profiler's self CPU time per step by op category, each approach profiled for one step
    per round, the approaches alternated (the load spreads over all of them)."""
    from torch.profiler import ProfilerActivity, profile

    out = {ap.name: {} for ap in approaches}
    ops: dict = {ap.name: {} for ap in approaches}  # op -> [ms per step, calls per step]
    for r in range(rounds):
        for ap in approaches:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                ap.step_fn(data[r % len(data)], False)
            for ev in prof.key_averages():
                if not ev.key.startswith("aten::"):
                    continue
                cat = _category(ev.key)
                out[ap.name][cat] = out[ap.name].get(cat, 0.0) + ev.self_cpu_time_total / 1e3 / rounds
                ms_calls = ops[ap.name].setdefault(ev.key, [0.0, 0])
                ms_calls[0] += ev.self_cpu_time_total / 1e3 / rounds
                ms_calls[1] += ev.count // rounds
    for name, by_op in ops.items():  # the heaviest ops of each approach, beside its categories
        out[name]["top_ops"] = sorted(([k, *v] for k, v in by_op.items()), key=lambda t: -t[1])[:10]
    return out


def render_profile(prof: dict) -> str:
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = ["Where a step's time goes (torch.profiler self CPU ms per step, aten ops by category):",
             f"{'approach':<16}" + "".join(f"{c:>15}" for c in cats) + f"{'total':>10}"]
    for name, by in prof.items():
        total = sum(v for k, v in by.items() if k in cats)
        lines.append(f"{name:<16}" + "".join(f"{by.get(c, 0.0):>15.0f}" for c in cats) + f"{total:>10.0f}")
    for name, by in prof.items():
        lines.append(f"{name}: heaviest ops (ms per step, calls per step)")
        lines += [f"  {op:<60}{ms:>9.0f}{calls:>7}" for op, ms, calls in by["top_ops"]]
    return "\n".join(lines)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    weights, arch = apr_weights(args)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
            for _ in range(args.warmup + args.steps)]
    approaches, skipped = [], {}
    for name in args.only:
        t0 = time.perf_counter()
        try:
            ap = build(args, name, weights, arch)
            bench_engine.warm(ap, data[:args.warmup], torch.device("cpu"))
        except (Skip, NotImplementedError) as why:  # NotImplementedError: a peer's op has no CPU kernel
            skipped[name] = str(why)
            print(f"  {name}: skipped: {why}", file=sys.stderr, flush=True)
            continue
        ap.warm_s = time.perf_counter() - t0
        approaches.append(ap)
        print(f"  {name}: built and warmed ({ap.warm_s:.1f} s)", file=sys.stderr, flush=True)
    for i, batch in enumerate(data[args.warmup:]):
        for ap in approaches:
            bench_engine.timed_step(ap, batch, torch.device("cpu"))
        print(f"  round {i + 1}/{args.steps}", file=sys.stderr, flush=True)
    profiled = profile_approaches(approaches, data[args.warmup:]) if args.profile else None
    base = next((ap for ap in approaches if ap.name == "baseline"), None)
    tokens = args.batch * args.seq
    rows = []
    for ap in approaches:
        losses = [float(x) for x in ap.losses]
        cpu = statistics.median(ap.cpu_times)
        paired = None if base is None else [b / t for b, t in zip(base.cpu_times, ap.cpu_times, strict=True)]
        first = None if base is None else abs(losses[0] - float(base.losses[0])) / abs(float(base.losses[0]))
        rows.append({"approach": ap.name, "cpu_ms_median": cpu * 1e3, "cpu_ms_min": min(ap.cpu_times) * 1e3,
                     "cpu_ms_max": max(ap.cpu_times) * 1e3, "tokens_per_cpu_s": tokens / cpu,
                     "vs_baseline": None if base is None else statistics.median(base.cpu_times) / cpu,
                     "paired_median": None if paired is None else statistics.median(paired),
                     "paired_min": None if paired is None else min(paired),
                     "paired_max": None if paired is None else max(paired),
                     "loss_step1": losses[0], "dloss_step1": first, "last_loss": losses[-1],
                     "warm_s": ap.warm_s, "note": ap.note})
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": f"{bench_engine.cpu_name()}, {os.cpu_count()} CPUs", "loadavg": os.getloadavg(),
            "python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "versions": _versions(), "shape": {k: getattr(args, k) for k in
                                               ("hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch")},
            "warmup": args.warmup, "steps": args.steps, "results": rows, "skipped": skipped,
            "profile": profiled}


def _write_e2e_inputs(args, root: Path, steps: int, weights: dict, arch, compiled: bool = False) -> dict:
    """The token array (shards for apr, .npy for litgpt), litgpt's initial checkpoint (apr's weights)
    and both configs for a run of ``steps`` steps; returns the two command lines."""
    import numpy as np
    from bench_runloop import write_data

    from apr.plan.examples import to_yaml

    rows = (max(args.e2e_steps) + 2) * args.batch  # one array for every length
    data = root / "data"
    if not data.exists():
        write_data(data, rows=rows, seq=args.seq, vocab=args.vocab)  # np.random.default_rng(0) rows
    npy = root / "tokens.npy"
    if not npy.exists():
        np.save(npy, np.random.default_rng(0).integers(0, args.vocab, size=(rows, args.seq + 1)).astype(np.uint32))
    init = root / "litgpt-init"
    if not (init / "lit_model.pth").exists():
        from litgpt.config import Config
        from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama

        init.mkdir(parents=True, exist_ok=True)
        state: dict = {}
        copy_weights_hf_llama(_litgpt_config(Config, args, arch), {}, state, dict(weights))
        torch.save(state, init / "lit_model.pth")
    apr_cfg = root / f"apr-{steps}{'-compile' if compiled else ''}.yaml"
    apr_cfg.write_text(to_yaml({
        "model": {"architecture": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                                   "num_attention_heads": args.heads, "num_key_value_heads": args.heads,
                                   "intermediate_size": args.intermediate, "vocab_size": args.vocab,
                                   "max_position_embeddings": args.seq}},
        "data": {"train": str(data), "batch_size": args.batch, "seq_len": args.seq, "shuffle": False},
        "optimizer": {"lr": LR, "weight_decay": 0.1},
        "training": {"max_steps": steps, "warmup_steps": 0, "lr_scheduler": "constant", "device": "cpu",
                     "mixed_precision": "fp32", "output_dir": str(root / f"apr-run-{steps}-{time.time_ns()}"),
                     "loss_chunk_size": args.seq, "grad_clip": 1.0, "seed": bench_engine.SEED,
                     "log_interval": args.e2e_log_interval, "eval_interval": 0,
                     "execution": {"compile": compiled}},
        "monitoring": {"tracking": {"experiment": "bench-peers"}}}))
    lit_cfg = root / f"litgpt-{steps}.yaml"
    out = root / f"litgpt-out-{steps}-{time.time_ns()}"
    lit_cfg.write_text(to_yaml({
        "model_name": "apr-bench-llama",
        "model_config": {"name": "apr-bench-llama", "block_size": args.seq, "vocab_size": args.vocab,
                         "padded_vocab_size": args.vocab, "n_layer": args.layers, "n_head": args.heads,
                         "n_embd": args.hidden, "n_query_groups": args.heads, "rotary_percentage": 1.0,
                         "parallel_residual": False, "bias": False, "norm_class_name": "RMSNorm",
                         "norm_eps": arch.rms_norm_eps, "mlp_class_name": "LLaMAMLP",
                         "intermediate_size": args.intermediate, "rope_base": int(arch.rope_theta)},
        "out_dir": str(out), "precision": "32-true", "initial_checkpoint_dir": str(init),
        "data": {"class_path": "peers_litgpt_data.TokenArray", "init_args": {"path": str(npy)}},
        "train": {"save_interval": 100000, "log_interval": args.e2e_log_interval, "global_batch_size": args.batch,
                  "micro_batch_size": args.batch, "max_tokens": steps * args.batch * args.seq, "max_norm": 1.0,
                  "lr_warmup_steps": 0, "min_lr": LR, "tie_embeddings": False},
        "eval": {"interval": 100000, "max_iters": 2, "initial_validation": False, "final_validation": False},
        "optimizer": {"class_path": "torch.optim.AdamW",
                      "init_args": {"lr": LR, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8}},
        "devices": 1, "logger_name": "csv", "seed": bench_engine.SEED}))
    return {"apr": [sys.executable, "-m", "apr", "train", "apply", str(apr_cfg)],
            "apr+compile": [sys.executable, "-m", "apr", "train", "apply", str(apr_cfg)],
            "litgpt": [sys.executable, "-m", "litgpt", "pretrain", "--config", str(lit_cfg)],
            "litgpt_out": out}


def _litgpt_config(Config, args, arch):
    return Config(name="bench", block_size=args.seq, vocab_size=args.vocab, padded_vocab_size=args.vocab,
                  n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, n_query_groups=_kv_heads(args),
                  rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                  norm_eps=arch.rms_norm_eps, mlp_class_name="LLaMAMLP", intermediate_size=args.intermediate,
                  rope_base=int(arch.rope_theta))


def _first_loss(tool: str, stderr: str, litgpt_out: Path) -> float | None:
    import csv
    import re

    if tool.startswith("apr"):
        m = re.search(r"step +1/\d+ +loss ([0-9.]+)", stderr)
        return float(m.group(1)) if m else None
    for path in sorted(litgpt_out.rglob("metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("loss"):
                    return float(row["loss"])
    return None


def _timed_command(cmd: list[str], env: dict) -> tuple[float, float, subprocess.CompletedProcess]:
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done


def run_e2e(args, weights: dict, arch) -> dict:
    import tempfile

    tools = ["apr", "apr+compile"] if args.e2e_apr_compile else ["apr"]
    skipped = {}
    try:
        import litgpt  # noqa: F401
        tools.append("litgpt")
    except ImportError as err:
        skipped["litgpt pretrain"] = f"litgpt is not installed ({err}); pip install -e '.[bench]'"
    short, long = args.e2e_steps
    runs: dict[str, dict[int, list]] = {t: {short: [], long: []} for t in tools}
    first: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "APR_CPU_THREADS": str(args.threads),
               "APR_HOME": str(root / "home"),
               "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
        for tool in list(tools):  # untimed: the token cache and inductor's compile cache warm, as on a second run
            cmds = _write_e2e_inputs(args, root, short, weights, arch, compiled=tool == "apr+compile")
            done = subprocess.run(cmds[tool], env=env, capture_output=True, text=True, cwd=str(REPO))
            print(f"  e2e {tool}: untimed first run, exit {done.returncode}", file=sys.stderr, flush=True)
        for _ in range(args.e2e_repeats):
            for steps in (short, long):
                for tool in tools:
                    cmds = _write_e2e_inputs(args, root, steps, weights, arch, compiled=tool == "apr+compile")
                    wall, cpu, done = _timed_command(cmds[tool], env)
                    if done.returncode != 0:
                        tail = (done.stderr or done.stdout)[-1500:]
                        if tool == "litgpt":
                            skipped["litgpt pretrain"] = f"exit {done.returncode}: {tail}"
                            tools.remove("litgpt")
                            runs.pop("litgpt")
                            print(f"  litgpt pretrain failed, skipped: {tail}", file=sys.stderr, flush=True)
                            break
                        raise RuntimeError(f"apr train apply failed (exit {done.returncode}): {tail}")
                    runs[tool][steps].append({"wall_s": wall, "cpu_s": cpu})
                    first.setdefault(tool, _first_loss(tool, done.stderr, cmds["litgpt_out"]))
                    print(f"  e2e {tool} {steps} steps: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr,
                          flush=True)
    tokens = args.batch * args.seq
    rows = []
    for tool, by_len in runs.items():
        c_short = statistics.median(r["cpu_s"] for r in by_len[short])
        c_long = statistics.median(r["cpu_s"] for r in by_len[long])
        w_long = statistics.median(r["wall_s"] for r in by_len[long])
        per_step = (c_long - c_short) / (long - short)
        command = {"apr": "apr train apply", "apr+compile": "apr apply+compile"}.get(tool, "litgpt pretrain")
        rows.append({"command": command,
                     "cpu_s_short": c_short, "cpu_s_long": c_long, "wall_s_long": w_long,
                     "marginal_cpu_ms_per_step": per_step * 1e3, "tokens_per_cpu_s": tokens / per_step,
                     "fixed_cpu_s": c_short - short * per_step, "whole_command_tokens_per_cpu_s":
                         long * tokens / c_long, "loss_step1": first.get(tool)})
    return {"steps": [short, long], "repeats": args.e2e_repeats, "log_interval": args.e2e_log_interval,
            "results": rows, "skipped": skipped}


def render_e2e(e2e: dict, engine_base_ms: float | None) -> str:
    short, long = e2e["steps"]
    out = ["", f"End to end: whole commands at {short} and {long} steps (log_interval {e2e['log_interval']}, "
               f"median of {e2e['repeats']}); per step: marginal child CPU time",
           f"{'command':<17} {'CPU ms/step':>11} {'x litgpt':>8} {'x loop':>7} {'fixed CPU s':>11} "
           f"{'whole tok/CPU s':>15} {'loss@1':>8}"]
    lit = next((r for r in e2e["results"] if r["command"] == "litgpt pretrain"), None)
    for r in e2e["results"]:
        vs_lit = "-" if lit is None else f"{lit['marginal_cpu_ms_per_step'] / r['marginal_cpu_ms_per_step']:.3f}"
        vs_loop = "-" if not engine_base_ms else f"{engine_base_ms / r['marginal_cpu_ms_per_step']:.3f}"
        loss = "-" if r["loss_step1"] is None else f"{r['loss_step1']:.4f}"
        out.append(f"{r['command']:<17} {r['marginal_cpu_ms_per_step']:>11.0f} {vs_lit:>8} {vs_loop:>7} "
                   f"{r['fixed_cpu_s']:>11.1f} {r['whole_command_tokens_per_cpu_s']:>15.0f} {loss:>8}")
    out.append("x loop: the engine table's baseline median CPU ms per step over this (that loop timed in this "
               "process, these as commands: indicative).")
    out += [f"{name}: skipped: {why}" for name, why in e2e["skipped"].items()]
    return "\n".join(out)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("litgpt", "torchtitan"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def render(res: dict) -> str:
    s = res["shape"]
    out = [f"bench_peers  {res['date']}  {res['machine']}, load {[round(x, 1) for x in res['loadavg']]}  "
           f"python {res['python']}  torch {res['torch']}, {res['threads']} thread(s)  {res['versions']}",
           f"hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads, intermediate {s['intermediate']}, "
           f"vocab {s['vocab']}; batch {s['batch']} x seq {s['seq']}; fp32; {res['warmup']} warm-up + "
           f"{res['steps']} timed steps, round-robin", ""]
    head = (f"{'approach':<16} {'CPU ms/step':>11} {'min':>7} {'max':>7} {'x base':>7} {'paired':>7} "
            f"{'paired range':>13} {'dloss@1':>8} {'build+warm s':>12}")
    out += [head, "-" * len(head)]
    for r in res["results"]:
        def fmt(v, spec):
            return "-" if v is None else format(v, spec)
        rng = "-" if r["paired_min"] is None else f"{r['paired_min']:.2f}-{r['paired_max']:.2f}"
        out.append(f"{r['approach']:<16} {r['cpu_ms_median']:>11.0f} {r['cpu_ms_min']:>7.0f} {r['cpu_ms_max']:>7.0f} "
                   f"{fmt(r['vs_baseline'], '.3f'):>7} {fmt(r['paired_median'], '.3f'):>7} {rng:>13} "
                   f"{fmt(r['dloss_step1'], '.1e'):>8} {r['warm_s']:>12.1f}")
    out += ["", "x base: the baseline's median CPU ms per step over this one's (tokens/s ratio; > 1 is faster).",
            "paired: median (and range) over rounds of baseline / this in the same round. dloss@1: step 1's loss",
            "relative to the baseline's (same weights, same batch)."]
    out += [f"{r['approach']}: {r['note']}" for r in res["results"]]
    out += [f"{name}: skipped: {why}" for name, why in res["skipped"].items()]
    return "\n".join(out)


def _threads(value: str, p: argparse.ArgumentParser) -> int:
    """``--threads``: a positive number, or ``auto``, apr's own choice (printed, so the run's record
    and the benchmark's can be compared)."""
    if value == "auto":
        from apr.threads import choose, describe

        choice = choose()
        print(f"threads: {describe(choice)}", file=sys.stderr)
        return choice["threads"]
    if not value.isdigit() or int(value) < 1:
        p.error(f"--threads: a positive number or auto, not {value!r}")
    return int(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 256), ("layers", 6), ("heads", 4), ("intermediate", 1024), ("vocab", 8192),
                          ("seq", 256), ("batch", 8), ("warmup", 2), ("steps", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--threads", default="1", help="torch threads for every approach and command: a number, or "
                   "auto: apr's own choice for one process on this machine (apr/threads.py: usable cores, "
                   "APR_CPU_THREADS, OMP_NUM_THREADS), which apply would make")
    p.add_argument("--only", type=lambda s: s.split(","), default=list(DEFAULT),
                   help=f"comma-separated subset of {','.join(APPROACHES)}")
    p.add_argument("--e2e", action="store_true", help="also time the whole commands (apr train apply, litgpt pretrain)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-level table")
    p.add_argument("--e2e-steps", type=lambda s: tuple(int(x) for x in s.split(",")), default=(4, 12))
    p.add_argument("--e2e-repeats", type=int, default=1)
    p.add_argument("--e2e-log-interval", type=int, default=1)
    p.add_argument("--e2e-apr-compile", action="store_true",
                   help="end to end, also apr with training.execution.compile: true")
    p.add_argument("--profile", action="store_true",
                   help="after the timed rounds, torch.profiler's self CPU time per step by op category")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.threads = _threads(args.threads, p)
    if set(args.only) - set(APPROACHES):
        p.error(f"--only: unknown {sorted(set(args.only) - set(APPROACHES))}")
    if len(args.e2e_steps) != 2 or not 1 <= args.e2e_steps[0] < args.e2e_steps[1]:
        p.error("--e2e-steps: two step counts, short,long")
    res = {"results": [], "skipped": {}} if args.no_engine else run(args)
    bad = [r["approach"] for r in res["results"] if r["dloss_step1"] is not None and r["dloss_step1"] > 1e-4]
    if args.e2e:
        weights, arch = apr_weights(args)
        res["e2e"] = run_e2e(args, weights, arch)
        losses = [r["loss_step1"] for r in res["e2e"]["results"]]
        if None not in losses and len(losses) > 1 and max(losses) - min(losses) > 1e-3:
            bad.append("litgpt pretrain (end to end)")
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        if not args.no_engine:
            print(render(res))
            if res.get("profile"):
                print(render_profile(res["profile"]))
        if args.e2e:
            base = next((r["cpu_ms_median"] for r in res["results"] if r["approach"] == "baseline"), None)
            print(render_e2e(res["e2e"], base))
    if bad:
        sys.exit(f"step 1's loss differs from the baseline's by more than 1e-4 relative: {', '.join(bad)}")


if __name__ == "__main__":
    main()
