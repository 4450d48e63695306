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

The update is the updater's ``update_group`` over the group's local shards (apr/train/updaters.py;
AdamW: the kernel backend's ``adamw_step``, the CuPy RawKernel on CUDA; SGD, SWATS and Lion too),
with the engine's sticky non-finite flag as ``found_inf`` and the shard group's sum for what needs the
whole group; the moments are DTensors (AdamW: in the torch optimizer's state, never stepped by torch)
so checkpoints gather and re-shard them as for the standard engine. A group's squared norm is
all-reduced over the shard group in its hook (every rank decides clipping and non-finite skips alike).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from apr.kernels.interface import DecayRanges
from apr.model import spec
from apr.train.nonfinite import LOSS
from apr.train.updaters import Piece, ShardSum


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
        # what needs the whole group (SWATS' dot products, Lion's update norm) sums over the shard group
        self._reduce = ShardSum(engine.layout.shard_group, engine.device)
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
        if self.e.strategy.clip == "adagc":  # canonical: the whole tensors' norms (canonical_grads took them)
            self.e._adagc_clip(name, grads, 1.0 / self.e.scaler.scale, found_inf,
                               norms=self.e.layout.tensor_norms(grads, name))
        scale = coef if self.e.scaler.scale == 1.0 else coef * (1.0 / self.e.scaler.scale)
        pieces = []
        for p, g in zip(self.group_params[name], grads, strict=True):
            local = p.to_local()
            if local.numel() == 0:  # a rank past the tensor's last row holds nothing of it
                continue
            m, v = self.e.updater.moments(p)
            pieces.append(Piece(local.view(-1), g.reshape(-1), m.to_local().view(-1), v.to_local().view(-1),
                                self._decay[id(p)]))
        self.e.updater.update_group(name, pieces, lr=self._lr, step=self.e.optimizer_steps + 1, grad_scale=scale,
                                    found_inf=found_inf, reduce=self._reduce)
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

    # The source's side of ``Engine.train_step`` (apr/train/engine.py), the step ended by apr/train/finish.py.
    holds_all_grads = False  # only when the strategy keeps them (accumulation, or asked)
    reads_host = False  # a non-finite norm is a device flag (fp16 aside)

    @property
    def sq_scale(self) -> float:
        """The group norms are of the loss-scaled gradient shards."""
        return self.e.scaler.scale

    def accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Gradient shards accumulate over the micro-batches (reduce-scattered after each); returns
        the mean loss and each group's squared norm over the shard group."""
        if self.e.layout.canonical is not None:
            return self._canonical_accumulate(micro_batches)
        self.release()
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
        return loss_total, dict(zip(self.e.group_names, sq_all.unbind(), strict=True))

    def _canonical_accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``training.reduction: canonical``: no micro-batch is reduce-scattered; each one's whole
        gradient (of its loss times the loss scale) is moved into a bucket of its own by the layout
        (``Shards.keep_micro``), and ``Shards.canonical_grads`` sums this rank's shard of every global
        micro-batch in the fixed tree, still loss-scaled, as the shards' ``.grad``. The groups' squared
        norms are the whole mean gradient's (the same bits on any world size)."""
        layout = self.e.layout
        self.release()
        layout.root.set_requires_gradient_sync(False)
        try:
            for batch in micro_batches:
                ids, targets = self.e.split(batch)
                loss = self._loss(ids, targets)
                self._backward(loss, self.e.scaler.scale, None)
                layout.keep_micro(loss)
        finally:
            layout.root.set_requires_gradient_sync(True)
        local, loss = layout.canonical_grads(unscale=False)
        for name in self.e.group_names:
            self.e._probe(name)
        return loss, layout.group_sq(local)

    def apply_all(self, coefs: dict, *, lr: float, loss: torch.Tensor) -> None:
        self._lr = lr
        for name in self.e.group_names:
            self._apply(name, coefs[name])

    def release(self) -> None:
        for p in self.params.named.values():
            p.grad = None

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        """One micro-batch's forward: its mean loss, the graph kept for the backward passes."""
        self.release()
        ids, targets = self.e.split(batch)
        return self._loss(ids, targets)

    def norms(self, loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A norm-only backward (the graph retained; each group's gradient shard reduced to its squared
        norm and dropped); the squared norms all-reduced over the shard group at once."""
        sq: dict[str, torch.Tensor] = {}

        def record(name: str) -> None:
            sq[name] = self.e.layout.local_sq(self._grads(name))
            self._drop(name)

        self._backward(loss, self.e.scaler.scale, record, retain=True)
        sq_all = self.e.layout.all_sq([sq[name] for name in self.e.group_names])
        return loss.detach(), dict(zip(self.e.group_names, sq_all.unbind(), strict=True))

    def step_pass(self, loss: torch.Tensor, coefs: dict, *, lr: float) -> None:
        """The stepping backward, each group's shard updated in its hook."""
        self._lr = lr
        self._backward(loss, self.e.scaler.scale, lambda name: self._apply(name, coefs[name]))

    def stream(self, loss: torch.Tensor, coef_of, *, lr: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One backward, each group's shard updated in its hook (``coef_of``: its clipping coefficient
        from its squared norm, None to skip it)."""
        self._lr = lr
        sq: dict[str, torch.Tensor] = {}
        if self.e.step_gate is not None:
            self.e._gate(loss.detach(), None)  # the loss test, before the first update

        def step(name: str) -> None:
            sq[name] = self._group_sq(name)
            coef = coef_of(sq[name])
            if coef is None:
                self._drop(name)
            else:
                self._apply(name, coef)

        self._backward(loss, 1.0, step)
        return loss.detach(), sq

    # ------------------------------------------------------------ what every source answers

    @property
    def groups(self) -> list[tuple[str, list[torch.Tensor]]]:
        return self.params.groups
