"""Plain autograd: a gradient source of the engine (apr/train/engine.py; docs/design.md, "The
composed engine"), and the replicated layout its state lives in.

``Params``: the model's trained tensors by optimizer group (and the loss part's own), bound to the
updater: the state of every source that is not the flat-buffer walk. ``Replicated``: that state whole
on every rank; gradients averaged over the data-parallel ranks in one all-reduce (FSDP2's layout is
``sharded.Shards``, with the same interface). ``Autograd``: every micro-batch's loss part
backpropagated, then the one step finisher (apr/train/finish.py) on the layout's reduced gradients.
"""

from __future__ import annotations

import torch

from apr.checkpoint import names
from apr.memory import buffers as planned_buffers
from apr.model import spec
from apr.model.trunk import load_trunk_state, trunk_state
from apr.train.engine import LOSS_GROUP, group_specs
from apr.train.finish import clip_
from apr.train.reduction import CanonicalSum


class Params:
    """The trained parameters by optimizer group in buffer-plan order, the loss part's in their own
    group (no weight decay), bound to the engine's updater."""

    def __init__(self, engine):
        self.e = engine
        config = engine.config
        named = dict(engine.model.named_parameters())
        self.groups = [(name, [named[s.name] for s in specs]) for name, specs in group_specs(config)]
        self.named = {s.name: named[s.name] for _, specs in group_specs(config) for s in specs}
        extra = engine.loss_parameters()
        if extra:
            self.groups.append((LOSS_GROUP, list(extra.values())))
            self.named.update(extra)
            if engine.adagc_ema:
                engine.adagc_ema[LOSS_GROUP] = torch.zeros(len(extra), device=engine.device)
        decay_names = self.decay_names = {s.name for _, specs in group_specs(config) for s in specs if s.decay}
        engine.updater.bind(self.named, decay_names, engine.device, groups=self.groups)
        self.trunk = bool(spec.trunk_specs(config))  # a transformed stacking trunk, outside the groups

    def adopt(self, old, new) -> None:
        """A switch of updater between two steps (the orchestrator's strategies): ``new`` bound over
        these parameters, taking ``old``'s moments (SGD's momentum is AdamW's first moment), its bias
        correction continuing from the run's update count, as on the walk's shared flat buffers."""
        new.bind(self.named, self.decay_names, self.e.device, groups=self.groups)
        self.freeze(set(self.e.frozen))  # a bind starts with nothing frozen
        own = self.e.loss.per_param_steps  # distillation: each parameter's own update count
        for p in self.named.values():
            moments = old.moments(p)
            if moments is not None:
                steps = old.steps_of(p) if own else None
                new.set_moments(p, *moments, self.e.optimizer_steps if steps is None else steps)

    def freeze(self, frozen: set[str]) -> None:
        """Frozen groups leave the updater: no update of their weights or moments."""
        self.e.updater.freeze([p for name, ps in self.groups if name in frozen for p in ps])

    def meta_state(self) -> dict:
        if not self.e.loss.per_param_steps:
            return {}
        # each parameter's own AdamW step count (distillation's phase 1)
        steps = {name: self.e.updater.steps_of(p) for name, p in self.named.items()}
        return {"param_steps": {name: n for name, n in steps.items() if n is not None}}

    def load_meta_state(self, meta: dict) -> None:
        e = self.e
        saved = meta.get("param_steps") or {} if e.loss.per_param_steps else {}
        for name, p in self.named.items():
            e.updater.set_steps(p, saved.get(name, 0) if e.loss.per_param_steps else e.optimizer_steps)

    def buffer_bytes(self) -> dict[str, int]:
        """Parameters, gradients and AdamW moments (after a step), by component."""
        out = {"weights": 0, "gradients": 0, "adamw_m": 0, "adamw_v": 0}
        for p in self.named.values():
            out["weights"] += p.untyped_storage().nbytes()
            if p.grad is not None:
                out["gradients"] += p.grad.untyped_storage().nbytes()
            for t, component in zip(self.e.updater.moments(p) or (), ("adamw_m", "adamw_v"), strict=False):
                out[component] += t.untyped_storage().nbytes()
        return out


class Replicated:
    """The whole state on every rank (one process, or DDP): gradients averaged in one all-reduce."""

    def __init__(self, engine):
        self.e = engine
        engine.model.to(engine.device)
        self.params = Params(engine)
        # training.reduction: canonical (apr/train/reduction.py): each micro-batch's gradient kept apart
        # and summed in a fixed tree over the global micro-batch index, whatever the world size
        self.canonical = CanonicalSum(engine.dp) if engine.plan.reduction == "canonical" else None

    def live(self) -> dict[str, list[torch.Tensor]]:
        """Each group whose every parameter has a gradient (distillation's phase 1 trains one block)."""
        return {name: [p.grad for p in group] for name, group in self.params.groups
                if all(p.grad is not None for p in group)}

    def keep_micro(self, loss: torch.Tensor) -> None:
        """Canonical: move this micro-batch's gradients into a leaf of their own."""
        live = self.live()
        self.live_names = list(live)  # the same groups every micro-batch and on every rank
        self.canonical.take([g for gs in live.values() for g in gs], loss)
        for p in self.params.named.values():
            p.grad = None

    def canonical_grads(self) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
        """Canonical: the groups' mean gradients over the global batch (set as ``.grad``, unscaled) and
        the mean loss, both summed in the fixed tree (every rank alike)."""
        e = self.e
        live_names = set(self.live_names)
        flat, loss = self.canonical.reduce()
        if e.scaler.scale != 1.0:
            flat.mul_(1.0 / e.scaler.scale)
        offset, local = 0, {}
        for name, group in self.params.groups:
            if name not in live_names:
                continue
            local[name] = []
            for p in group:
                p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
                local[name].append(p.grad)
        return local, loss

    def micro_loss(self, ids: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        return self.e.loss(self.e, self.e.model, ids, targets)

    def reduced_grads(self) -> dict[str, list[torch.Tensor]]:
        """Each live group's gradients (a group with every parameter's gradient; distillation's
        phase 1 trains one block), averaged over the data-parallel ranks and unscaled."""
        e = self.e
        local = self.live()
        grads = [g for gs in local.values() for g in gs]
        if e.dp is not None and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            e.dp.average_(flat)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(parts, grads, strict=True)])
        if e.scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / e.scaler.scale)
        return local

    def group_sq(self, local: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every group's squared norm over its concatenated gradients (the reduction of the walk's flat
        buffers, so the two sources agree bitwise); zero for a group without gradients."""
        zero = torch.zeros((), dtype=torch.float32, device=self.e.device)
        return {name: self.e.backend.sq_norm(torch.cat([g.reshape(-1) for g in local[name]])) if name in local
                else zero for name, _ in self.params.groups}

    def train_state_tensors(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self.params.named.items():
            m, v = self.e.updater.moments(p) or (torch.zeros_like(p), torch.zeros_like(p))
            out[name] = p.detach()
            out[names.OPT_M + name] = m
            out[names.OPT_V + name] = v
        if self.params.trunk:  # a stacking trunk's frozen tensors (docs/design.md, "StackWise progressive stacks")
            out.update(trunk_state(self.e.model, self.e.config))
        return out

    @torch.no_grad()
    def load_train_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        e = self.e
        e._check_state_names(tensors)
        for name, p in self.params.named.items():
            p.copy_(tensors[name])
            e.updater.set_moments(p, tensors[names.OPT_M + name].to(p.device, torch.float32).clone(),
                                  tensors[names.OPT_V + name].to(p.device, torch.float32).clone(),
                                  e.optimizer_steps)
        if self.params.trunk:
            load_trunk_state(e.model, e.config, tensors)


class Autograd:
    """Autograd over the model on the engine's layout, its step ended by ``finish.known`` (clip, the
    updater): one process, DDP and FSDP2 shards alike."""

    name = "standard"
    declares = staticmethod(planned_buffers.autograd_buffers)  # torch allocates these at the declared sizes

    def __init__(self, engine):
        self.e = engine
        self.params = engine.layout.params
        self.idle_groups: set[str] = set()  # groups the last step gave no gradient (apr/train/blocknorms.py)

    @property
    def groups(self) -> list[tuple[str, list[torch.Tensor]]]:
        return self.params.groups

    @property
    def named(self) -> dict[str, torch.Tensor]:
        return self.params.named

    # The source's side of ``Engine.train_step`` (apr/train/engine.py), the step ended by apr/train/finish.py.
    holds_all_grads = True  # a whole backward, then the update
    reads_host = True  # the textbook loop: the loss and the norm are read every step
    sq_scale = 1.0  # the norms are of the unscaled, reduced gradients

    def accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Every micro-batch backpropagated, the gradients reduced over the layout's ranks and
        unscaled; returns the mean loss and every group's squared norm."""
        layout = self.e.layout
        for p in self.named.values():
            p.grad = None
        loss = self._backward(micro_batches)
        for name, _ in self.groups:
            self.e._probe(name)
        if getattr(layout, "canonical", None) is not None:
            self._local, loss = layout.canonical_grads()
        else:
            self._local = layout.reduced_grads()
        self.idle_groups = {name for name, _ in self.groups} - set(self._local)
        return loss, layout.group_sq(self._local)

    def apply_all(self, coefs: dict, *, lr: float, loss: torch.Tensor) -> None:
        """Clip the reduced gradients by ``coefs`` (AdaGC: per tensor), then the updater's step at the
        LR the loss part asks for."""
        clip_(self.e, self._local, coefs)
        self.e.updater.step(lr * self.e.loss.lr_factor(loss))

    def release(self) -> None:
        """The gradients stay on the parameters until the next step (what torch's loop does)."""
        self._local = {}

    def _backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Every micro-batch's loss part, backpropagated (scaled by the fp16 loss scale and divided
        by the micro-batches); returns the step's mean loss."""
        e = self.e
        accum, scale = len(micro_batches), e.scaler.scale
        canonical = getattr(e.layout, "canonical", None) is not None
        mult = scale if canonical else scale / accum  # canonical: divided by the global count after the sum
        loss_total = torch.zeros((), device=e.device)
        for k, batch in enumerate(micro_batches):
            ids, targets = e.split(batch)
            loss = e.layout.micro_loss(ids, targets, last=k == accum - 1)
            e._check_loss(loss)
            (loss * mult if mult != 1.0 else loss).backward()
            if canonical:
                e.layout.keep_micro(loss)
            else:
                loss_total += loss.detach() / accum
        return loss_total
