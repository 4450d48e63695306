"""The updater part of the composed engine (docs/design.md, "The composed engine"): what turns a
finished gradient into new weights, apart from where the gradient came from.

**One interface**, ``update_group(group, pieces, lr=, step=, grad_scale=, found_inf=, reduce=)``:
one optimizer group's update, called by every gradient source as the group's gradient is finished.
A ``Piece`` is a flat float32 (or bf16) view of weights with its gradient, moments and the ranges
weight decay applies to:

- the flat-buffer walk hands the group's one flat buffer (one piece);
- the walk on FSDP2 shards hands each tensor's local shard (one piece each) and ``reduce``, the sum
  over the shard group, for what needs the whole group (SWATS' dot products, Lion's update norm);
- autograd hands the group's parameters gathered into flat tensors (``GroupedUpdates.step``, one
  process or DDP) or their local shards (FSDP2, with ``reduce``).

``update_flat`` is the one-piece call (the walk's, and tests'). ``step(lr)`` is every bound group's
``update_group`` after a whole autograd backward: ``GroupedUpdates`` hands flat pieces (or shards);
AdamW hands the parameters themselves, updated by torch's multi-tensor AdamW (fused on CUDA: the plain
loop's speed; bitwise what ``torch.optim.AdamW.step`` gives). Adafactor alone keeps torch's optimizer
step over every parameter at once.

``AdamW`` is the default updater: ``update_group`` is the kernel backend's fused AdamW (the CuPy
RawKernel on CUDA, torch ops on the CPU) piece by piece. With ``training.state_dtype: bf16`` the
walk's weights and moments are bfloat16 (6 bytes a parameter instead of 12): the update in float32,
written back with stochastic rounding, its noise a hash of (run seed, step, group, element index), so
a resumed run draws what the run straight drew (apr/kernels/interface.py ``rounding_keys``).

Its moments are ``exp_avg`` / ``exp_avg_sq`` (checkpointed as ``optimizer.m.`` / ``optimizer.v.``):
in the buffer plan's flat buffers for the walk, in ``torch.optim.AdamW``'s per-parameter state for
the autograd sources and the sharded walk (``moments`` / ``set_moments``). SGD, SWATS and Lion
inherit ``bind`` / ``step`` from ``GroupedUpdates`` and run on every source and layout, FSDP2
included. ``Adafactor`` is torch's, bound like AdamW's; it factors each matrix's statistics by
shape, which flat buffers and row shards do not carry, so it runs on autograd without sharding only
(the two physical refusals, at ``optimizer.name``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.optim.adam import adam

from apr.config.schema import OptimizerConfig
from apr.errors import AprError
from apr.kernels import KernelBackend
from apr.kernels.interface import DecayRanges, rounding_keys


class Piece(NamedTuple):
    """A flat part of one optimizer group (see the module docstring): its weights, gradient, moments,
    the ranges weight decay applies to, and where the new weights go in the compute dtype."""

    params: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: DecayRanges
    param_copy: torch.Tensor | None = None
    param: torch.Tensor | None = None  # autograd: the parameter itself (AdamW: its torch state and step count)


class ShardSum:
    """``reduce`` for pieces that are shards: the sum over the shard group (every rank calls it for
    every group, in the same order, with zeros where it holds none of the group)."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def zeros(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)


class Updater:
    """The one interface every gradient source calls (see the module docstring). An elementwise
    updater implements ``_update_piece``; one that needs the whole group overrides ``update_group``."""

    name = ""

    def update_group(self, group: str, pieces: list[Piece], *, lr: float, step: int, grad_scale=1.0,
                     found_inf: torch.Tensor | None = None, reduce=None) -> None:
        """Update one optimizer group in place: ``grad_scale`` multiplies each gradient first (the clip
        coefficient, 1 / loss scale); ``found_inf`` (a device flag) makes it write nothing; ``reduce``
        (shards only) sums a tensor over the ranks holding the group's other pieces."""
        for piece in pieces:
            self._update_piece(piece, lr=lr, step=step, grad_scale=grad_scale, found_inf=found_inf, group=group)

    def update_flat(self, params: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, step: int, decay, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                    param_copy: torch.Tensor | None = None, group: str | None = None) -> None:
        """``update_group`` with the group as one flat piece (the flat-buffer walk)."""
        self.update_group(group or "", [Piece(params, grad, exp_avg, exp_avg_sq, decay, param_copy)], lr=lr,
                          step=step, grad_scale=grad_scale, found_inf=found_inf)

    def _update_piece(self, piece: Piece, *, lr: float, step: int, grad_scale, found_inf, group: str) -> None:
        raise NotImplementedError


class AdamW(Updater):
    name = "adamw"

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        self.lr = opt.lr
        self.beta1, self.beta2, self.eps, self.weight_decay = opt.beta1, opt.beta2, opt.eps, opt.weight_decay
        self.backend = backend
        self.optimizer: torch.optim.AdamW | None = None  # after ``bind``
        # bf16 state's stochastic rounding draws from (seed, step, group): the engine sets the run's seed
        self.rounding_seed = 0

    # ------------------------------------------------------------------ flat pieces, one group at a time

    def _update_piece(self, piece: Piece, *, lr: float, step: int, grad_scale, found_inf, group: str) -> None:
        """One fused AdamW update of a flat piece in place. bf16 tensors (``training.state_dtype:
        bf16``): the update in float32, written back with stochastic rounding keyed by
        (``rounding_seed``, ``step``, ``group``)."""
        params = piece.params
        rounding = rounding_keys(self.rounding_seed, step, group) if params.dtype == torch.bfloat16 else None
        self.backend.adamw_step(params, piece.grad, piece.exp_avg, piece.exp_avg_sq, lr=lr, beta1=self.beta1,
                                beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay, step=step,
                                decay=piece.decay, grad_scale=grad_scale, found_inf=found_inf,
                                param_copy=piece.param_copy, rounding=rounding)

    # ------------------------------------------------------------------ named parameters, after a backward

    def bind(self, named: dict[str, torch.Tensor], decay_names: set[str], device: torch.device,
             groups: list[tuple[str, list[torch.Tensor]]] | None = None) -> None:
        """Hold torch's AdamW over these parameters (decayed ones, then the rest without decay): its
        per-parameter state (moments, step counts) and settings; ``step`` updates them group by group."""
        params = list(named.items())
        self.optimizer = self._torch_optimizer(
            [{"params": [p for n, p in params if n in decay_names], "weight_decay": self.weight_decay},
             {"params": [p for n, p in params if n not in decay_names], "weight_decay": 0.0}], device)
        names = {id(p): n for n, p in params}
        self._bound = [(g, [(p, names.get(id(p)) in decay_names) for p in ps])
                       for g, ps in (groups or [("all", [p for _, p in params])])]
        self._frozen: set[int] = set()

    def _torch_optimizer(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                                 fused=(device.type == "cuda") or None)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Every bound group's ``update_group`` after an autograd backward, each parameter with a
        gradient a piece (a parameter without one keeps its moments and step count, as in torch)."""
        for pg in self.optimizer.param_groups:  # what torch's optimizer would say the step ran at
            pg["lr"] = lr
        for gname, params in self._bound:
            pieces = [self._param_piece(p, decayed) for p, decayed in params
                      if p.grad is not None and id(p) not in self._frozen]
            if pieces:
                self.update_group(gname, pieces, lr=lr, step=0)

    def _param_piece(self, p: torch.Tensor, decayed: bool) -> Piece:
        if self.moments(p) is None:  # torch's lazy state, as its AdamW makes it: zero moments, step 0
            fused = bool(self.optimizer.defaults.get("fused"))  # the step on the device only when fused
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        m, v = self.moments(p)
        return Piece(p, p.grad, m, v, DecayRanges.from_segments([(p.numel(), decayed)]), param=p)

    def update_group(self, group: str, pieces: list[Piece], *, lr: float, step: int, grad_scale=1.0,
                     found_inf: torch.Tensor | None = None, reduce=None) -> None:
        """Flat pieces: the kernel backend's fused AdamW, piece by piece. Parameters (autograd): torch's
        multi-tensor AdamW (``torch.optim.adam.adam`` with decoupled decay, fused on CUDA), the rule
        and kernels ``torch.optim.AdamW.step`` runs, over the group's decayed, then undecayed ones,
        each at its own step count (``step`` is unused there)."""
        if not pieces or pieces[0].param is None:
            return super().update_group(group, pieces, lr=lr, step=step, grad_scale=grad_scale,
                                        found_inf=found_inf, reduce=reduce)
        defaults = self.optimizer.defaults
        for decayed in (True, False):
            chosen = [pc for pc in pieces if bool(pc.decay.ranges) == decayed]
            if not chosen:
                continue
            states = [self.optimizer.state[pc.param] for pc in chosen]
            adam([pc.param for pc in chosen], [pc.grad for pc in chosen], [pc.exp_avg for pc in chosen],
                 [pc.exp_avg_sq for pc in chosen], [], [st["step"] for st in states], amsgrad=False,
                 has_complex=False, beta1=self.beta1, beta2=self.beta2, lr=lr,
                 weight_decay=self.weight_decay if decayed else 0.0, eps=self.eps, maximize=False,
                 foreach=defaults.get("foreach"), capturable=False, differentiable=False,
                 fused=defaults.get("fused"), grad_scale=grad_scale if isinstance(grad_scale, torch.Tensor) else None,
                 found_inf=found_inf, decoupled_weight_decay=True)

    def set_hyper(self, beta1: float, beta2: float, weight_decay: float) -> None:
        """A strategy's betas and decay (the orchestrator), in torch's groups too once bound."""
        self.beta1, self.beta2, self.weight_decay = beta1, beta2, weight_decay
        if self.optimizer is not None:
            for pg in self.optimizer.param_groups:
                pg["betas"] = (beta1, beta2)
            self.optimizer.param_groups[0]["weight_decay"] = weight_decay  # ``bind``: the decayed group first

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def freeze(self, params: list[torch.Tensor]) -> None:
        """These parameters leave the update: no change to their weights or moments."""
        held = {id(p) for p in params}
        self._frozen |= held
        for pg in self.optimizer.param_groups:
            pg["params"] = [p for p in pg["params"] if id(p) not in held]

    def weight_decay_of(self) -> dict[torch.Tensor, float]:
        return {p: pg["weight_decay"] for pg in self.optimizer.param_groups for p in pg["params"]}

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``p``'s (exp_avg, exp_avg_sq), or None before its first update."""
        state = self.optimizer.state.get(p)
        if not state or "exp_avg" not in state:
            return None
        return state["exp_avg"], state["exp_avg_sq"]

    def set_moments(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float) -> None:
        """Adopt moments (a checkpoint's, or zeros for an update outside torch's AdamW) and the step count
        bias correction continues from; the count lives where torch's fused AdamW expects it."""
        fused = bool(self.optimizer.defaults.get("fused"))
        where = p.device if fused else "cpu"  # as torch's AdamW places it, DTensors included (its _init_group)
        self.optimizer.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=where),
                                   "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def steps_of(self, p: torch.Tensor) -> int | None:
        state = self.optimizer.state.get(p)
        return int(state["step"]) if state else None

    def set_steps(self, p: torch.Tensor, step: float) -> None:
        state = self.optimizer.state.get(p)
        if state is not None:
            state["step"].fill_(float(step))


class GroupedUpdates(Updater):
    """``bind`` / ``step`` for SGD, SWATS and Lion after an autograd backward: ``update_group`` per
    optimizer group, in the walk's group order.

    - One process or DDP (every rank holds whole groups): the group's weights and gradients gathered
      into flat float32 tensors, its moments kept flat per group (per-parameter views for
      checkpoints): the walk's update, element for element.
    - FSDP2 (the parameters are DTensors): one piece per parameter, its local shard, the moments
      DTensors sharded like it (checkpoints gather and re-shard them as AdamW's), and ``reduce`` the
      sum over the mesh's shard dimension (hybrid replicas hold equal shards).

    An updater with one moment (``second_moment = False``: Lion) holds no second buffer unsharded
    (its checkpointed ``optimizer.v.`` is a view of one zero); on shards it holds zeros like AdamW's
    second moment (the plan counts them)."""

    optimizer = None  # no torch.optim object: apr/train/blocknorms.py reads the groups' moments instead
    second_moment = True

    def bind(self, named: dict[str, torch.Tensor], decay_names: set[str], device: torch.device,
             groups: list[tuple[str, list[torch.Tensor]]] | None = None) -> None:
        names = {id(p): n for n, p in named.items()}
        self._groups: list[tuple[str, list[torch.Tensor], DecayRanges, torch.Tensor, torch.Tensor]] = []
        self._views: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
        self._decayed: dict[int, bool] = {}
        self._steps: dict[str, int] = {}
        self._frozen: set[int] = set()
        self._reduce = None
        for gname, params in groups or [("all", list(named.values()))]:
            for p in params:
                self._decayed[id(p)] = names.get(id(p)) in decay_names
            if params and hasattr(params[0], "device_mesh"):  # FSDP2: per-parameter sharded moments
                self._bind_shards(gname, params)
                continue
            decay = DecayRanges.from_segments([(p.numel(), self._decayed[id(p)]) for p in params])
            total = sum(p.numel() for p in params)
            m = torch.zeros(total, dtype=torch.float32, device=device)
            v = torch.zeros(total if self.second_moment else 1, dtype=torch.float32, device=device)
            offset = 0
            for p in params:
                n = p.numel()
                v_view = v[offset:offset + n].view_as(p) if self.second_moment else v[0].expand_as(p)
                self._views[id(p)] = (gname, m[offset:offset + n].view_as(p), v_view)
                offset += n
            self._groups.append((gname, params, decay, m, v))

    def _bind_shards(self, gname: str, params: list[torch.Tensor]) -> None:
        mesh = params[0].device_mesh
        self._reduce = ShardSum(mesh.get_group("shard") if mesh.ndim > 1 else mesh.get_group(),
                                params[0].to_local().device)
        for p in params:
            self._views[id(p)] = (gname, torch.zeros_like(p, dtype=torch.float32),
                                  torch.zeros_like(p, dtype=torch.float32))
        self._groups.append((gname, params, None, None, None))

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for gname, params, decay, m, v in self._groups:
            if all(id(p) in self._frozen for p in params) or any(p.grad is None for p in params):
                continue  # frozen, or no gradient this step (distillation's other blocks)
            self._steps[gname] = self._steps.get(gname, 0) + 1
            if m is None:  # shards: each parameter's local rows, updated in place
                self.update_group(gname, self.shard_pieces(params), lr=lr, step=self._steps[gname],
                                  reduce=self._reduce)
                continue
            flat = torch.cat([p.detach().reshape(-1).float() for p in params])
            grad = torch.cat([p.grad.reshape(-1).float() for p in params])
            self.update_group(gname, [Piece(flat, grad, m, v, decay)], lr=lr, step=self._steps[gname])
            torch._foreach_copy_([p.data for p in params],
                                 [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params,
                                                               strict=True)])

    def shard_pieces(self, params: list[torch.Tensor]) -> list[Piece]:
        """Each parameter's local shard as a piece (a rank past a tensor's last row holds none of it)."""
        pieces = []
        for p in params:
            local = p.detach().to_local()
            if local.numel() == 0:
                continue
            _, m, v = self._views[id(p)]
            pieces.append(Piece(local.view(-1), p.grad.to_local().reshape(-1), m.to_local().view(-1),
                                v.to_local().view(-1), DecayRanges.from_segments([(local.numel(),
                                                                                   self._decayed[id(p)])])))
        return pieces

    def freeze(self, params: list[torch.Tensor]) -> None:
        self._frozen.update(id(p) for p in params)

    def weight_decay_of(self) -> dict[torch.Tensor, float]:
        return {p: (self.weight_decay if self._decayed[id(p)] else 0.0) for _, ps, *_ in self._groups for p in ps}

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        _, m, v = self._views[id(p)]
        return m, v

    def set_moments(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float) -> None:
        gname, m, v = self._views[id(p)]
        m.copy_(exp_avg)
        if self.second_moment:  # one moment: the checkpoint's optimizer.v. is zeros, nothing to adopt
            v.copy_(exp_avg_sq)
        self._steps[gname] = int(step)

    def steps_of(self, p: torch.Tensor) -> int | None:
        return self._steps.get(self._views[id(p)][0])

    def set_steps(self, p: torch.Tensor, step: float) -> None:
        self._steps[self._views[id(p)][0]] = int(step)


# The SGD and SWATS updaters (docs/design.md, "Orchestrated training"): on the flat-buffer walk they
# update each group's flat buffers in the walk; on autograd ``GroupedUpdates`` hands ``update_group``
# each group gathered (one process, DDP) or its local shards (FSDP2). Both keep their momentum in
# AdamW's first-moment buffer, so they need no memory AdamW does not already have.


class SGD(GroupedUpdates):
    """SGD with momentum ``beta1`` kept as an EMA of the gradient (dampening 1 - beta1): the same
    quantity, in the same buffer, as AdamW's first moment, so the orchestrator can switch between
    the two at any step without a cold start. Decoupled weight decay ``lr x weight_decay``."""

    name = "sgd"

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        self.lr = opt.lr
        self.beta1, self.beta2, self.eps, self.weight_decay = opt.beta1, opt.beta2, opt.eps, opt.weight_decay
        self.backend = backend

    @torch.no_grad()
    def _update_piece(self, piece: Piece, *, lr: float, step: int, grad_scale, found_inf, group: str) -> None:
        params, grad, exp_avg = piece.params, piece.grad, piece.exp_avg
        decay, param_copy = piece.decay, piece.param_copy
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            grad.mul_(grad_scale)
        if found_inf is None:
            _decay(params, lr * self.weight_decay, decay)
            exp_avg.lerp_(grad, 1 - self.beta1)
            params.add_(exp_avg, alpha=-lr)
        else:  # an fp16 overflow or a non-finite step writes nothing; decided on the device, no host read
            keep = (~found_inf).to(params.dtype)
            for s, e in decay.ranges if self.weight_decay != 0.0 else ():
                params[s:e].mul_(1 - lr * self.weight_decay * keep)
            exp_avg.lerp_(torch.where(found_inf, exp_avg, grad), 1 - self.beta1)
            params.sub_(exp_avg * (lr * keep))
        if param_copy is not None:
            param_copy.copy_(params)

    def set_hyper(self, beta1: float, beta2: float, weight_decay: float) -> None:
        self.beta1, self.beta2, self.weight_decay = beta1, beta2, weight_decay

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass


class SWATS(GroupedUpdates):
    """SWATS (Keskar & Socher 2017, "Improving Generalization Performance by Switching from Adam to
    SGD"), per optimizer group (a block: the paper's per-layer variant, which is what the walk's
    one-group-at-a-time update can do).

    AdamW phase: after each step ``p`` (the AdamW step without decay, lr included), the SGD learning
    rate that would make the same progress along the gradient ``g`` is ``gamma = p.p / -p.g``; an EMA
    ``lam`` of it (decay beta2) is bias-corrected as ``lam / (1 - beta2^k)``. Once ``k >
    swats_min_steps`` and the corrected EMA is within ``swats_tolerance`` of ``gamma``, the group
    switches for good to SGD with momentum ``v = beta1 v + g`` (in the first-moment buffer, zeroed at
    the switch) and ``w -= (1 - beta1) x Lambda x v``, Lambda the corrected estimate scaled by the
    schedule since the switch (``lr / lr_at_switch``). The phase, ``lam``, Lambda and the switch's
    step and lr are the updater's state (checkpointed in the engine's meta): a resume across the
    switch is exact. Reads two dot products per group per step on the host until that group switches.
    """

    name = "swats"

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        self.lr = opt.lr
        self.beta1, self.beta2, self.eps, self.weight_decay = opt.beta1, opt.beta2, opt.eps, opt.weight_decay
        self.min_steps, self.tolerance = opt.swats_min_steps, opt.swats_tolerance
        self.backend = backend
        self.groups: dict[str, dict] = {}  # group -> {"lam", "switched_at", "sgd_lr", "lr_at_switch"}

    @torch.no_grad()
    def update_group(self, group: str, pieces: list[Piece], *, lr: float, step: int, grad_scale=1.0,
                     found_inf: torch.Tensor | None = None, reduce=None) -> None:
        """Each piece's update, then (AdamW phase) the switch test on the whole group's two dot
        products: summed over the pieces, and over the shards with ``reduce``."""
        if found_inf is not None and bool(found_inf):
            return
        state = self.groups.setdefault(group, {"lam": 0.0, "switched_at": None, "sgd_lr": None, "lr_at_switch": None})
        dots = [self._piece(piece, state, lr, step, grad_scale) for piece in pieces]
        if state["switched_at"] is None:
            if reduce is not None:  # every rank calls the collective, with or without rows of the group
                dots = [reduce(sum(dots[1:], dots[0]) if dots else reduce.zeros(2, dtype=torch.float64))]
            total = dots[0] if len(dots) == 1 else sum(dots[1:], dots[0])
            pg, pp = (float(x) for x in total)
            if pg != 0.0:
                gamma = pp / -pg
                state["lam"] = self.beta2 * state["lam"] + (1 - self.beta2) * gamma
                corrected = state["lam"] / (1 - self.beta2 ** step)
                if step > self.min_steps and abs(corrected - gamma) < self.tolerance and corrected > 0:
                    state.update(switched_at=step, sgd_lr=corrected, lr_at_switch=lr)
                    for piece in pieces:
                        piece.exp_avg.zero_()  # SGD's momentum starts from zero (the paper's v_0)
        for piece in pieces:
            if piece.param_copy is not None:
                piece.param_copy.copy_(piece.params)

    def _piece(self, piece: Piece, state: dict, lr: float, step: int, grad_scale) -> torch.Tensor | None:
        """One piece's update; in the AdamW phase, its (p.g, p.p) in float64 for the switch test."""
        params, grad, exp_avg, exp_avg_sq = piece.params, piece.grad, piece.exp_avg, piece.exp_avg_sq
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            grad.mul_(grad_scale)
        _decay(params, lr * self.weight_decay, piece.decay)
        if state["switched_at"] is not None:
            exp_avg.mul_(self.beta1).add_(grad)
            rate = state["sgd_lr"] * (lr / state["lr_at_switch"] if state["lr_at_switch"] else 1.0)
            params.add_(exp_avg, alpha=-(1 - self.beta1) * rate)
            return None
        exp_avg.lerp_(grad, 1 - self.beta1)
        exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        denom = (exp_avg_sq / (1 - self.beta2 ** step)).sqrt_().add_(self.eps)
        p = exp_avg.div(denom).mul_(-lr / (1 - self.beta1 ** step))
        params.add_(p)
        return torch.stack([torch.dot(p, grad), torch.dot(p, p)]).double()

    def set_hyper(self, beta1: float, beta2: float, weight_decay: float) -> None:
        self.beta1, self.beta2, self.weight_decay = beta1, beta2, weight_decay

    def switched(self) -> dict[str, int]:
        """The groups on SGD and the step each switched at."""
        return {name: s["switched_at"] for name, s in self.groups.items() if s["switched_at"] is not None}

    def state_dict(self) -> dict:
        return {"swats": {name: dict(s) for name, s in self.groups.items()}}

    def load_state_dict(self, state: dict | None) -> None:
        self.groups = {name: dict(s) for name, s in ((state or {}).get("swats") or {}).items()}


class Lion(GroupedUpdates):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), per element:
    ``c = beta1 m + (1 - beta1) g``; ``w -= lr (sign(c) + wd w)`` (decay on the decayed ranges only);
    ``m = beta2 m + (1 - beta2) g``. One moment, in the first-moment buffer (``optimizer.m.``); the
    walk's second buffer stays zero. Each group's squared update norm is kept (``update_sq``, device
    tensors, for monitoring.block_norms), as the state after the step cannot give it."""

    name = "lion"
    second_moment = False

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        self.lr = opt.lr
        self.beta1, self.beta2, self.eps, self.weight_decay = opt.beta1, opt.beta2, opt.eps, opt.weight_decay
        self.backend = backend
        self.update_sq: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def update_group(self, group: str, pieces: list[Piece], *, lr: float, step: int, grad_scale=1.0,
                     found_inf: torch.Tensor | None = None, reduce=None) -> None:
        """Each piece's update; the group's squared update norm summed over the pieces (and the shards)."""
        sqs = [self._piece(piece, lr, grad_scale, found_inf) for piece in pieces]
        if reduce is not None:
            sqs = [reduce(torch.stack(sqs).sum() if sqs else reduce.zeros(dtype=torch.float32))]
        if sqs:
            self.update_sq[group] = sqs[0] if len(sqs) == 1 else torch.stack(sqs).sum()

    def _piece(self, piece: Piece, lr: float, grad_scale, found_inf) -> torch.Tensor:
        params, grad, exp_avg = piece.params, piece.grad, piece.exp_avg
        decay, param_copy = piece.decay, piece.param_copy
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            grad.mul_(grad_scale)
        rate = lr
        if found_inf is not None:  # a flagged step writes nothing; decided on the device, no host read
            grad = torch.where(found_inf, exp_avg, grad)  # the momentum stands in: m and c stay finite
            rate = lr * (~found_inf).to(params.dtype)
        direction = exp_avg.lerp(grad, 1 - self.beta1).sign_()
        if self.weight_decay != 0.0:
            for s, e in decay.ranges:
                direction[s:e].add_(params[s:e], alpha=self.weight_decay)
        sq = torch.dot(direction, direction) * rate * rate
        if isinstance(rate, torch.Tensor):
            params.sub_(direction.mul_(rate))
        else:
            params.sub_(direction, alpha=rate)
        exp_avg.lerp_(grad, 1 - self.beta2)
        if param_copy is not None:
            param_copy.copy_(params)
        return sq

    def set_hyper(self, beta1: float, beta2: float, weight_decay: float) -> None:
        self.beta1, self.beta2, self.weight_decay = beta1, beta2, weight_decay

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass


class Adafactor(AdamW):
    """``torch.optim.Adafactor`` over named parameters (autograd sources only): per matrix a row and a
    column statistic of the squared gradient (a vector keeps its whole second moment), no first
    moment, a relative step ``min(lr, 1/sqrt(step)) x max(eps2, RMS(w))`` and decoupled weight decay
    ``lr x weight_decay``. Checkpoints keep the parameter-shaped names: ``optimizer.m.<name>`` holds
    the row statistic repeated along each row, ``optimizer.v.<name>`` the column statistic repeated
    down each column (a vector: its second moment, and m zeros); resume takes one row and one column
    back, bitwise. The walk hands an updater flat buffers without the matrices' shapes: refused there
    (apr train validate), and ``update_flat`` says why if it is reached anyway."""

    name = "adafactor"

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        super().__init__(opt, backend)
        self.beta2_decay, self.eps1, self.eps2 = opt.adafactor_beta2_decay, opt.adafactor_eps1, opt.adafactor_eps2
        self.clip_threshold = opt.adafactor_clip_threshold
        self.update_sq: dict[str, torch.Tensor] = {}  # not derivable from the state: block update norms unknown
        self._zero: dict[torch.device, torch.Tensor] = {}

    def _torch_optimizer(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(groups, lr=self.lr, beta2_decay=self.beta2_decay, eps=(self.eps1, self.eps2),
                                     d=self.clip_threshold)

    def step(self, lr: float) -> None:
        """torch's Adafactor over every parameter at once (its factored statistics need each matrix)."""
        for pg in self.optimizer.param_groups:
            pg["lr"] = lr
        self.optimizer.step()

    def update_group(self, *args, **kwargs) -> None:
        raise AprError("optimizer.name adafactor keeps row and column statistics of each weight matrix, but the "
                       "flat-buffer walk hands the updater a group's flat buffer without the matrices' shapes: "
                       "use training.engine: standard (apr train validate refuses this config)")

    def set_hyper(self, beta1: float, beta2: float, weight_decay: float) -> None:
        self.weight_decay = weight_decay
        if self.optimizer is not None:
            self.optimizer.param_groups[0]["weight_decay"] = weight_decay  # ``bind``: the decayed group first

    def _zeros_like(self, p: torch.Tensor) -> torch.Tensor:
        zero = self._zero.setdefault(p.device, torch.zeros((), dtype=torch.float32, device=p.device))
        return zero.expand_as(p)

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Parameter-shaped views of ``p``'s statistics (no copy): the row statistic and the column
        statistic broadcast, or zeros and a vector's second moment; None before its first update."""
        state = self.optimizer.state.get(p)
        if not state or "step" not in state:
            return None
        if "row_var" in state:
            return state["row_var"].expand_as(p), state["col_var"].expand_as(p)
        return self._zeros_like(p), state["variance"]

    def set_moments(self, p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float) -> None:
        state = {"step": torch.tensor(float(step), dtype=torch.float32)}
        if p.dim() > 1:
            state["row_var"] = exp_avg[..., :1].clone()
            state["col_var"] = exp_avg_sq[..., :1, :].clone()
        else:
            state["variance"] = exp_avg_sq
        self.optimizer.state[p] = state


def _decay(params: torch.Tensor, amount: float, decay) -> None:
    if amount != 0.0:
        for s, e in decay.ranges:
            params[s:e].mul_(1 - amount)


UPDATERS = {"adamw": AdamW, "sgd": SGD, "swats": SWATS, "lion": Lion, "adafactor": Adafactor}


def make_updater(opt: OptimizerConfig, backend: KernelBackend, name: str | None = None):
    """The updater ``name`` (default ``optimizer.name``) over the run's optimizer settings."""
    return UPDATERS[name or str(opt.name)](opt, backend)
