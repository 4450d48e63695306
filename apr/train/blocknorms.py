"""Per-block telemetry (``monitoring.block_norms``): each optimizer group's gradient norm and the
norm of the update AdamW applied to it, read at log steps only.

Gradient norms cost nothing extra: both engines already form each group's squared gradient norm
(the clipping arithmetic) and keep the last step's as device tensors (``Engine.group_sq``).

Update norms ``||w_new - w_old||`` are derived from AdamW's own state after the step, so no copy of
the weights is kept. With decoupled weight decay the step is
``w_new = w_old * (1 - lr*wd) - lr * u`` with ``u = m_hat / (sqrt(v_hat) + eps)`` (the moments and
their bias corrections after the step), so ``w_new - w_old = -lr * (wd * w_new + u) / (1 - lr*wd)``.
That is evaluated in chunks (one temporary of ``CHUNK_CPU``/``CHUNK_GPU`` elements, whatever the
group's size: a 7B model's embedding group is 2 GB in float32), one pass over w, m and v per log
step. A step that applied no update (fp16 overflow, a skipped bad step) has update norm 0.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist  # loaded by `import torch` anyway

from apr.track.state import BLOCK_NORM_LISTS

# Elements per temporary, bounded whatever the group's size: 1 MiB on the CPU (the temporary stays in
# the core's L2 cache across its four passes: on one synthetic 10.5M-element group 2.3-2.6x less CPU
# than 16 MiB chunks at 1 and 2 threads, but on a real engine's groups, whose moments come from main
# memory, only ~10%; 64K-element chunks cost more parallel regions than they save), 64 MiB on a GPU
# (few launches). docs/performance.md, "The run loop's overhead".
CHUNK_CPU = 1 << 18
CHUNK_GPU = 1 << 24

BLOCK_GRAD, BLOCK_UPDATE = BLOCK_NORM_LISTS  # the metric names: apr/track/state.py


def _update_sq_sum(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, wd: float, c: float,
                   eps: float) -> torch.Tensor:
    """``sum((wd*w + c*m / (sqrt(v) + eps))**2)`` over flat float32 views, chunk by chunk (four
    passes over a chunk-sized temporary: sqrt, +eps, addcdiv or div, dot)."""
    n = w.numel()
    total = torch.zeros((), dtype=torch.float32, device=w.device)
    chunk = CHUNK_CPU if w.device.type == "cpu" else CHUNK_GPU
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        t = torch.sqrt(v[start:end]).add_(eps)
        if wd:  # wd*w + c*m/t = wd * (w + (c/wd) * m/t)
            torch.addcdiv(w[start:end], m[start:end], t, value=c / wd, out=t)
        else:
            torch.div(m[start:end], t, out=t)
        total += torch.dot(t, t)
    return total * (wd * wd if wd else c * c)


def adamw_update_sq_norm(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, weight_decay: float,
                         beta1: float, beta2: float, eps: float, step: int,
                         decay_ranges: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
    """``||w_new - w_old||**2`` of the AdamW update that produced ``w`` (= w_new), ``m`` and ``v`` at
    1-based ``step`` with learning rate ``lr`` (0-dim float32 device tensor). ``decay_ranges``: the
    half-open element ranges weight decay applies to (None: all of them when ``weight_decay``)."""
    w, m, v = w.detach().reshape(-1), m.reshape(-1), v.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=w.device)
    if step < 1 or lr == 0.0:
        return total
    bc1, bc2_sqrt = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)
    # m_hat / (sqrt(v_hat) + eps) = c * m / (sqrt(v) + eps'), c = sqrt(bc2) / bc1, eps' = eps * sqrt(bc2)
    kw = {"c": bc2_sqrt / bc1, "eps": eps * bc2_sqrt}
    if decay_ranges is None:
        decay_ranges = ((0, w.numel()),) if weight_decay else ()
    at = 0
    for start, end in (*decay_ranges, (w.numel(), w.numel())):
        if start > at:  # the elements between decaying ranges
            total += _update_sq_sum(w[at:start], m[at:start], v[at:start], wd=0.0, **kw) * lr ** 2
        if end > start:
            total += (_update_sq_sum(w[start:end], m[start:end], v[start:end], wd=weight_decay, **kw)
                      * (lr / (1.0 - lr * weight_decay)) ** 2)
        at = max(at, end)
    return total


def group_update_sq_norms(engine, lr: float) -> dict[str, torch.Tensor]:
    """Each optimizer group's squared update norm of the engine's last applied step (device tensors)."""
    up = engine.updater
    kw = {"lr": lr, "beta1": up.beta1, "beta2": up.beta2, "eps": up.eps, "step": engine.optimizer_steps}
    # groups the step did not update: frozen ones, and those autograd's step left without a gradient
    idle = set(engine.frozen) | set(getattr(engine.gradients, "idle_groups", ()))
    own = getattr(up, "update_sq", None)  # Lion keeps its own; Adafactor's is unknown (NaN: not logged)
    if own is None and up.name != "adamw":  # SGD / SWATS: AdamW's formula does not apply (NaN: not logged)
        own = {}
    if own is not None:
        zero = torch.zeros((), dtype=torch.float32, device=engine.device)
        groups = engine.gradients.groups  # the walk's FlatGroups or autograd's (name, params)
        names = [g.name if hasattr(g, "name") else g[0] for g in groups]
        return {n: zero if n in idle else own.get(n, torch.full((), math.nan, device=engine.device))
                for n in names}
    if up.optimizer is not None:  # the autograd sources (and the sharded walk's moments): torch's AdamW
        decay = up.weight_decay_of()
        out = {}
        for name, params in engine.gradients.groups:
            total = torch.zeros((), dtype=torch.float32, device=engine.device)
            if name in idle:  # progressive stacking's frozen blocks, distillation's other blocks: no update
                out[name] = total
                continue
            for p in params:
                moments = up.moments(p)
                if moments:
                    total += adamw_update_sq_norm(_local(p), _local(moments[0]), _local(moments[1]),
                                                  weight_decay=decay[p], **kw)
            out[name] = total
        group = getattr(engine, "shard_group", None)
        if group is not None:  # FSDP2 shards: each rank summed its own rows; one all-reduce (every rank logs)
            sums = torch.stack(list(out.values()))
            dist.all_reduce(sums, group=group)
            out = dict(zip(out, sums.unbind(), strict=True))
        return out
    return {g.name: (torch.zeros((), dtype=torch.float32, device=engine.device) if g.name in idle else
                     adamw_update_sq_norm(g.flat_params, g.exp_avg, g.exp_avg_sq, weight_decay=up.weight_decay,
                                          decay_ranges=g.decay.ranges, **kw))
            for g in engine.gradients.groups}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter or moment's rows on this rank; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def block_metrics(engine, lr: float) -> dict:
    """The last step's per-group norms, read to the host in one transfer: ``block_grad_norm`` and
    ``block_update_norm`` (lists indexed by block), ``embed_*``/``head_*`` (absent under LoRA, whose
    embedding and head are frozen) and ``max_block_*``. A step that applied no update (fp16
    overflow, a skipped bad step: AdamW's count did not move) has update norms 0. ``lr``: the
    step's learning rate. Empty before the first step."""
    sq = engine.group_sq
    if not sq:
        return {}
    applied = engine.optimizer_steps > engine.group_sq_steps
    names = list(sq)
    grad = torch.stack([sq[n].float() for n in names])
    if applied:
        upd = group_update_sq_norms(engine, lr)
        update = torch.stack([upd[n] for n in names])
    else:
        update = torch.zeros_like(grad)
    values = torch.cat([grad, update]).sqrt().tolist()
    scale = engine.group_sq_scale
    grads = dict(zip(names, (_finite(x / scale) for x in values[:len(names)]), strict=True))
    updates = dict(zip(names, (_finite(x) for x in values[len(names):]), strict=True))
    blocks = sorted((n for n in names if n.startswith("block.")), key=lambda n: int(n.split(".")[1]))
    out: dict = {BLOCK_GRAD: [grads[n] for n in blocks], BLOCK_UPDATE: [updates[n] for n in blocks]}
    for part in ("embed", "head"):
        if part in grads:
            out[f"{part}_grad_norm"], out[f"{part}_update_norm"] = grads[part], updates[part]
    for key in (BLOCK_GRAD, BLOCK_UPDATE):
        finite = [x for x in out[key] if x is not None]
        out[f"max_{key}"] = max(finite) if finite else None
    return out
