"""bf16 training state (issue 51 item 4): does storing the weights and AdamW moments in bf16 keep
the demo's loss, and with which rounding? A measurement for the design, not apr's engine.

Usage (after `make demo` wrote demo-run/data):

    K_STEPS=200 .venv/bin/python benchmarks/bench_bf16_state.py fp32 rtn sr kahan
    .venv/bin/python benchmarks/bench_bf16_state.py bytes   # apr's engine: measured bytes per parameter

``bytes`` builds apr's engine for the demo config three ways (fp32 compute and state; bf16 compute,
fp32 state; bf16 compute, ``training.state_dtype: bf16``) and prints its buffers' measured bytes per
parameter by memory-table row (``engine.buffer_bytes()``); the loss of apr's own bf16 state is in
docs/performance.md, "bf16 state".

The demo config (configs/train/demo-tiny.yaml: its model, batch, AdamW and cosine schedule) trained
by a plain loop in float32 compute; only the storage of the state between steps differs:

- ``fp32``: weights, m and v in float32 (12 bytes a parameter);
- ``rtn``: all three in bf16, rounded to nearest after each update (6 bytes);
- ``sr``: all three in bf16 with stochastic rounding (16 random low bits added, then truncated:
  the expected stored value is the float32 one, so small updates survive on average; 6 bytes);
- ``kahan``: bf16 weights with a bf16 compensation term carrying what rounding dropped into the
  next update, moments stochastically rounded (8 bytes).

It prints the mean training loss of the last 10 steps, the validation loss (eval_batches rows of
demo-run/data/val) and the state's bytes per parameter (gradients, float32 in every mode, apart).

Measured 2026-11-28 (CPU, 200 steps, the demo's data):

    fp32   train (last 10) 4.3185  val 5.0025  state 12.0 B/param
    rtn    train (last 10) 4.4319  val 5.1160  state 6.0 B/param   (+2.6% / +2.3%: small updates lost)
    sr     train (last 10) 4.3054  val 4.9969  state 6.0 B/param   (-0.3% / -0.1%)
    kahan  train (last 10) 4.3224  val 5.0087  state 8.0 B/param   (+0.1% / +0.1%)
"""

from __future__ import annotations

import glob
import math
import os
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from apr.config import load_config
from apr.model.llama import build_model

torch.set_num_threads(1)
cfg = load_config("configs/train/demo-tiny.yaml").config
arch, opt, tr = cfg.model.architecture, cfg.optimizer, cfg.training
B, STEPS = cfg.data.batch_size, int(os.environ.get("K_STEPS", tr.max_steps))


def rows(folder: str) -> np.ndarray:
    files = sorted(glob.glob(f"{folder}/*.parquet"))
    tables = [pq.read_table(f).column(0).to_numpy(zero_copy_only=False) for f in files]
    return np.concatenate([np.stack(t) for t in tables]).astype(np.int64)


def lr_at(s: int) -> float:
    if s < tr.warmup_steps:
        return opt.lr * (s + 1) / tr.warmup_steps
    p = (s - tr.warmup_steps) / max(1, STEPS - tr.warmup_steps)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * p))


def stochastic_bf16(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """float32 -> bf16, rounded up with probability equal to the dropped fraction."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=gen)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def run(mode: str, train: np.ndarray, val: np.ndarray) -> tuple[float, float, float]:
    model = build_model(arch, tr.seed, device="cpu")
    params = list(model.parameters())
    decayed = [p.ndim == 2 and p is not model.model.embed_tokens.weight for p in params]
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    rounded = (lambda x: x.to(dtype)) if mode in ("fp32", "rtn") else (lambda x: stochastic_bf16(x, gen))
    w_state = [p.detach().to(dtype).clone() for p in params]
    m_state = [torch.zeros_like(w) for w in w_state]
    v_state = [torch.zeros_like(w) for w in w_state]
    carry = [torch.zeros_like(w) for w in w_state] if mode == "kahan" else []
    order = np.random.default_rng(0).permutation(len(train))
    losses = []
    for s in range(STEPS):
        with torch.no_grad():
            for p, w in zip(params, w_state, strict=True):
                p.copy_(w.float())
        start = (s * B) % len(train)
        loss = loss_of(model, torch.from_numpy(train[order[start:start + B]]))
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params))
        clip, lr, b1, b2 = min(1.0, tr.grad_clip / (norm + 1e-6)), lr_at(s), opt.beta1, opt.beta2
        with torch.no_grad():
            for i, p in enumerate(params):
                g = p.grad * clip
                m = m_state[i].float().mul_(b1).add_(g, alpha=1 - b1)
                v = v_state[i].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                w = w_state[i].float()
                step = (m / (1 - b1 ** (s + 1))) / ((v / (1 - b2 ** (s + 1))).sqrt() + opt.eps)
                update = -lr * (step + (opt.weight_decay * w if decayed[i] else 0.0))
                if mode == "kahan":
                    wanted = w + update + carry[i].float()
                    w_state[i] = wanted.to(dtype)
                    carry[i] = (wanted - w_state[i].float()).to(dtype)
                    m_state[i], v_state[i] = stochastic_bf16(m, gen), stochastic_bf16(v, gen)
                else:
                    w_state[i], m_state[i], v_state[i] = rounded(w + update), rounded(m), rounded(v)
    with torch.no_grad():
        for p, w in zip(params, w_state, strict=True):
            p.copy_(w.float())
        val_loss = np.mean([loss_of(model, torch.from_numpy(val[j * B:(j + 1) * B])).item()
                            for j in range(tr.eval_batches)])
    nbytes = sum(t.nbytes for t in w_state + m_state + v_state + carry)
    return float(np.mean(losses[-10:])), float(val_loss), nbytes / sum(w.numel() for w in w_state)


def measured_bytes() -> None:
    from apr.memory.buffers import walk_buffers
    from apr.model.spec import param_count
    from apr.plan.build import resolve_config
    from apr.train.build import build_engine

    n = param_count(arch)
    for precision, state in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")):
        config = cfg.model_copy(update={"training": tr.model_copy(update={"mixed_precision": precision,
                                                                          "state_dtype": state})})
        measured = build_engine(resolve_config(config, data=False)).buffer_bytes()
        rows: dict[str, int] = {}
        for b in walk_buffers(config):
            if b.name in measured:
                rows[b.component] = rows.get(b.component, 0) + measured[b.name]
        print(f"compute {precision} state {state}: " + ", ".join(f"{c} {v / n:.2f}" for c, v in rows.items())
              + f" B/param ({n} parameters)")


def main() -> None:
    if sys.argv[1:] == ["bytes"]:
        measured_bytes()
        return
    train, val = rows("demo-run/data/train"), rows("demo-run/data/val")
    for mode in sys.argv[1:] or ["fp32", "sr"]:
        t = time.time()
        torch.manual_seed(0)
        train_loss, val_loss, per_param = run(mode, train, val)
        print(f"{mode:6s} train (last 10) {train_loss:.4f}  val {val_loss:.4f}  state {per_param:.1f} B/param  "
              f"({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
