"""The walk's gradient source on FSDP2 shards (``training.engine: interleaved`` with ``training.sharding``).

The model is sharded as for the standard engine (apr/train/sharded.py: ``fully_shard`` per decoder
block and at the root), and keeps the interleaved engine's promises
(docs/design.md, "Sharding and elastic resume"):

* each block's gradient is reduce-scattered by FSDP2 as soon as that block's backward is done, and
  AdamW runs on the rank's shard of it right away, from FSDP2's post-accumulate-grad hook on the
  sharded parameters; the shard is then dropped, so at most one group's gradient shard (and the
  block's unsharded gradient FSDP2 is reducing) exists at a time. No rank ever holds the
  full-model gradient;
* the execution policy's per-block modes hold: ``keep`` blocks keep their graph, ``selective``
  and ``recompute`` blocks run under activation checkpointing inside FSDP2's units (the recompute
  runs with the block's weights gathered for its backward);
* the next block's weights are all-gathered while the current one computes (forward prefetch set
  per block; FSDP2 prefetches the previous block in the backward);
* the step strategy is the interleaved engine's (apr/steps/strategy.py): kept gradients (here: the
  gradient *shards*, reduce-scattered every micro-batch) when accumulating or asked; a norm-only
  backward first (the graph retained, gradients reduced to one squared norm per group and
  dropped) for exact global clipping or fp16's overflow check; else one backward with per-block
  (or no, or AdaGC) clipping decided in the hook.

AdamW is the kernel backend's (``adamw_step``, the CuPy RawKernel on CUDA), per local shard, with
the engine's sticky non-finite flag as ``found_inf``; the moments are DTensors in the torch
optimizer's state (never stepped by torch) so checkpoints gather and re-shard them as for the
standard engine. A group's squared norm is all-reduced over the shard group in its hook (every
rank decides clipping and non-finite skips alike).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from apr.kernels.interface import DecayRanges
from apr.model import spec
from apr.train.nonfinite import GRADIENTS, LOSS
from apr.train.outcome import StepResult


class ShardedWalk:
    """The walk's per-group updates on FSDP2 shards, from the gradient hooks (see the module docstring)."""

    name = "interleaved"

    def __init__(self, engine):
        self.e = engine
        self.params = engine.layout.params  # the sharded layout's parameters (apr/train/sharded.py)
        config = engine.config
        self._lr = 0.0
        self.group_params = dict(self.params.groups)
        decays = {s.name: s.decay for _, specs in spec.optimizer_groups(config) for s in specs}
        self._decay: dict[int, DecayRanges] = {}
        self._group_of: dict[int, str] = {}
        self._arrived = dict.fromkeys(self.group_params, 0)
        # (name) -> None, run once a group's reduce-scattered gradient is complete; None: accumulate
        self._on_group: Callable[[str], None] | None = None
        for name, group in self.params.groups:
            for p in group:
                self._group_of[id(p)] = name
                p.register_post_accumulate_grad_hook(self._arrived_grad)
        for pname, p in self.params.named.items():
            local = p.to_local()
            self._decay[id(p)] = DecayRanges.from_segments([(local.numel(), decays[pname])])
            self.e.updater.set_moments(p, torch.zeros_like(p), torch.zeros_like(p), 0)

    # ------------------------------------------------------------------------------ hooks

    def _arrived_grad(self, p: torch.Tensor) -> None:
        """FSDP2's post-accumulate-grad hook: ``p``'s shard of its reduce-scattered gradient is in
        ``p.grad``; once every parameter of the group has arrived, the group is done."""
        name = self._group_of[id(p)]
        self._arrived[name] += 1
        if self._arrived[name] == len(self.group_params[name]):
            self._arrived[name] = 0
            if self._on_group is not None:
                self.e._probe(name)
                self._on_group(name)

    def _grads(self, name: str) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.group_params[name]]

    def _drop(self, name: str) -> None:
        for p in self.group_params[name]:
            p.grad = None

    # ------------------------------------------------------------------------------ stepping

    @torch.no_grad()
    def _apply(self, name: str, coef) -> None:
        """AdamW on this rank's shard of every tensor of the group (then the gradient shard is dropped)."""
        found_inf = self.e._flags.bad
        if name in self.e.frozen:  # progressive stacking's frozen blocks: no update at all
            self._drop(name)
            return
        grads = self._grads(name)
        if self.e.strategy.clip == "adagc":
            self.e._adagc_clip(name, grads, 1.0 / self.e.scaler.scale, found_inf,
                               norms=self.e.layout.tensor_norms(grads))
        scale = coef if self.e.scaler.scale == 1.0 else coef * (1.0 / self.e.scaler.scale)
        for p, g in zip(self.group_params[name], grads, strict=True):
            local = p.to_local()
            if local.numel() == 0:  # a rank past the tensor's last row holds nothing of it
                continue
            m, v = self.e.updater.moments(p)
            self.e.updater.update_flat(local.view(-1), g.reshape(-1), m.to_local().view(-1), v.to_local().view(-1),
                                     lr=self._lr, step=self.e.optimizer_steps + 1, decay=self._decay[id(p)],
                                     grad_scale=scale, found_inf=found_inf)
        self.e._flags.stepped()
        self._drop(name)

    def _group_sq(self, name: str) -> torch.Tensor:
        return self.e.layout.all_sq([self.e.layout.local_sq(self._grads(name))])[0]

    def _backward(self, loss: torch.Tensor, mult: float, on_group, retain: bool = False) -> None:
        self._on_group = on_group
        try:
            (loss * mult if mult != 1.0 else loss).backward(retain_graph=retain)
        finally:
            self._on_group = None

    def _loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's mean loss; its non-finiteness flagged alike on every rank."""
        loss = self.e.layout.root(ids, targets)
        total = loss.detach().clone()
        dist.all_reduce(total)  # over every rank: hybrid replicas read other rows
        if self.e.scaler.enabled:  # fp16: the loss-scale logic reads the host
            self.e._check_loss(total)
        else:
            self.e._flags.flag(~torch.isfinite(total), LOSS, self.e.calls)
        return loss

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        self._lr = lr
        self.e.calls += 1
        self.e._skip = False
        self.e._flags.start_step()
        for p in self.params.named.values():
            p.grad = None
        if self.e.strategy.keeps_all_grads:
            return self._step_kept(micro_batches)
        ids, targets = self.e.split(micro_batches[0])
        loss = self._loss(ids, targets)
        if self.e.strategy.norm_prepass:
            return self._step_prepass(loss)
        return self._step_single(loss)

    def _step_kept(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """Gradient shards accumulate over the micro-batches (reduce-scattered after each); then the
        exact global norm, then every group's AdamW."""
        accum, scale = len(micro_batches), self.e.scaler.scale
        loss_total = torch.zeros((), device=self.e.device)
        for batch in micro_batches:
            ids, targets = self.e.split(batch)
            loss = self._loss(ids, targets)
            self._backward(loss, scale / accum, None)
            loss_total += loss.detach() / accum
        for name in self.e.group_names:
            self.e._probe(name)
        sq_all = self.e.layout.all_sq([self.e.layout.local_sq(self._grads(name)) for name in self.e.group_names])
        return self._step_known(loss_total, dict(zip(self.e.group_names, sq_all.unbind(), strict=True)),
                                lambda coefs: [self._apply(name, coefs[name]) for name in self.e.group_names])

    def _step_prepass(self, loss: torch.Tensor) -> StepResult:
        """A norm-only backward (the graph retained; each group's gradient shard reduced to its squared
        norm and dropped), then the stepping backward."""
        sq: dict[str, torch.Tensor] = {}

        def record(name: str) -> None:
            sq[name] = self.e.layout.local_sq(self._grads(name))
            self._drop(name)

        scale = self.e.scaler.scale
        self._backward(loss, scale, record, retain=True)
        sq_all = self.e.layout.all_sq([sq[name] for name in self.e.group_names])
        sq = dict(zip(self.e.group_names, sq_all.unbind(), strict=True))

        def step(coefs: dict) -> None:
            self._backward(loss, scale, lambda name: self._apply(name, coefs[name]))

        return self._step_known(loss.detach(), sq, step)

    def _step_known(self, loss: torch.Tensor, sq: dict[str, torch.Tensor], apply) -> StepResult:
        """With every group's squared norm known before any update: the non-finite / overflow check,
        the bad-step test, clipping coefficients, then ``apply(coefs)``."""
        self.e._keep_sq(sq, self.e.scaler.scale)
        norm, overflow = self.e._known_norm(sq)
        flagged = not overflow and self.e._gate(loss, norm)
        if not overflow and not flagged:
            apply(self.e._coefs(sq, norm))
            self.e._stepped()
        for p in self.params.named.values():
            p.grad = None
        return StepResult(loss, norm, skipped=overflow, flagged=flagged)

    def _step_single(self, loss: torch.Tensor) -> StepResult:
        """No clipping, per-block or AdaGC clipping: each group steps in its hook."""
        sq: dict[str, torch.Tensor] = {}
        per_block = self.e.strategy.clip == "per_block"
        if self.e.step_gate is not None:
            self.e._gate(loss.detach(), None)  # the loss test, before the first update

        def step(name: str) -> None:
            s = sq[name] = self._group_sq(name)
            if self.e._skip:
                self._drop(name)
                return
            self.e._flags.flag(~torch.isfinite(s), GRADIENTS, self.e.calls)
            self._apply(name, self.e._clip_coef(s.sqrt()) if per_block else 1.0)

        self._backward(loss, 1.0, step)
        self.e._keep_sq(sq)
        norm = torch.stack([sq[name] for name in self.e.group_names]).sum().sqrt()
        if self.e._skip:
            return StepResult(loss.detach(), norm, flagged=True)
        self.e._stepped()
        return StepResult(loss.detach(), norm)

    # ------------------------------------------------------------ what every source answers

    @property
    def groups(self) -> list[tuple[str, list[torch.Tensor]]]:
        return self.params.groups
