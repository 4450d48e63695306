"""The updater part of the composed engine (docs/design.md, "The composed engine"): what turns a
finished gradient into new weights, apart from where the gradient came from.

``AdamW`` is the default updater. It updates in two ways, one per kind of gradient source:

- ``update_flat``: the kernel backend's fused AdamW (the CuPy RawKernel on CUDA, torch ops on the
  CPU) on flat float32 tensors, one optimizer group (the flat-buffer walk) or one local shard
  (the walk under FSDP2) at a time, as soon as its gradient is complete;
- ``bind`` then ``step``: ``torch.optim.AdamW`` (fused on CUDA) over named parameters in two
  weight-decay groups, after a whole autograd backward (one process, DDP, FSDP2's DTensors).

With ``training.state_dtype: bf16`` the walk's weights and moments are bfloat16 (6 bytes a
parameter instead of 12): ``update_flat`` computes each update in float32 and writes the three back
with stochastic rounding, its noise a hash of (run seed, step, group, element index), so a resumed
run draws what the run straight drew (apr/kernels/interface.py ``rounding_keys``).

Its moments are ``exp_avg`` / ``exp_avg_sq`` (checkpointed as ``optimizer.m.`` / ``optimizer.v.``):
in the buffer plan's flat buffers for the walk, in ``torch.optim.AdamW``'s per-parameter state for
the autograd sources and the sharded walk (``moments`` / ``set_moments``). Another optimizer (SGD,
SWATS, Lion) implements ``update_flat`` and inherits ``bind`` / ``step`` from ``GroupedUpdates``:
every such updater has both interfaces, so each runs on every unsharded source; the engines call
nothing else. ``Adafactor`` is torch's, bound like AdamW's; it factors each matrix's statistics by
shape, which the walk's flat buffers do not carry, so it runs on the autograd sources only.
"""

from __future__ import annotations

import torch

from apr.config.schema import OptimizerConfig
from apr.errors import AprError
from apr.kernels import KernelBackend
from apr.kernels.interface import DecayRanges, rounding_keys


class AdamW:
    name = "adamw"

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        self.lr = opt.lr
        self.beta1, self.beta2, self.eps, self.weight_decay = opt.beta1, opt.beta2, opt.eps, opt.weight_decay
        self.backend = backend
        self.optimizer: torch.optim.AdamW | None = None  # after ``bind``
        # bf16 state's stochastic rounding draws from (seed, step, group): the engine sets the run's seed
        self.rounding_seed = 0

    # ------------------------------------------------------------------ flat tensors, one group at a time

    def update_flat(self, params: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, step: int, decay, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                    param_copy: torch.Tensor | None = None, group: str | None = None) -> None:
        """One fused AdamW update of flat float32 tensors in place; ``decay``: the ranges weight decay
        applies to; ``grad_scale`` multiplies the gradient first (clip coefficient, 1/loss scale);
        ``found_inf`` (a device flag) makes it write nothing; ``param_copy`` receives the new weights
        in the compute dtype. bf16 tensors (``training.state_dtype: bf16``): the update in float32,
        written back with stochastic rounding keyed by (``rounding_seed``, ``step``, ``group``)."""
        rounding = rounding_keys(self.rounding_seed, step, group or "") if params.dtype == torch.bfloat16 else None
        self.backend.adamw_step(params, grad, exp_avg, exp_avg_sq, lr=lr, beta1=self.beta1, beta2=self.beta2,
                                eps=self.eps, weight_decay=self.weight_decay, step=step, decay=decay,
                                grad_scale=grad_scale, found_inf=found_inf, param_copy=param_copy, rounding=rounding)

    # ------------------------------------------------------------------ named parameters, after a backward

    def bind(self, named: dict[str, torch.Tensor], decay_names: set[str], device: torch.device,
             groups: list[tuple[str, list[torch.Tensor]]] | None = None) -> None:
        """Hold torch's AdamW over these parameters: decayed ones, then the rest without decay."""
        params = list(named.items())
        self.optimizer = self._torch_optimizer(
            [{"params": [p for n, p in params if n in decay_names], "weight_decay": self.weight_decay},
             {"params": [p for n, p in params if n not in decay_names], "weight_decay": 0.0}], device)

    def _torch_optimizer(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                                 fused=(device.type == "cuda") or None)

    def step(self, lr: float) -> None:
        for pg in self.optimizer.param_groups:
            pg["lr"] = lr
        self.optimizer.step()

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
        where = p.device if fused and not hasattr(p, "device_mesh") else "cpu"
        self.optimizer.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=where),
                                   "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def steps_of(self, p: torch.Tensor) -> int | None:
        state = self.optimizer.state.get(p)
        return int(state["step"]) if state else None

    def set_steps(self, p: torch.Tensor, step: float) -> None:
        state = self.optimizer.state.get(p)
        if state is not None:
            state["step"].fill_(float(step))


class GroupedUpdates:
    """``bind`` / ``step`` for an updater whose update is ``update_flat`` (SGD, SWATS, Lion): after an
    autograd backward, one optimizer group at a time in the walk's group order, the group's weights
    and gradients gathered into flat float32 tensors, its moments kept flat per group (per-parameter
    views for checkpoints): the walk's update, element for element, on the autograd source. One
    process or DDP (every rank holds whole groups); sharded state is refused by validate. An updater
    with one moment (``second_moment = False``: Lion) holds no second buffer here; its checkpointed
    ``optimizer.v.`` is a view of one zero."""

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
        for gname, params in groups or [("all", list(named.values()))]:
            decay = DecayRanges.from_segments([(p.numel(), names.get(id(p)) in decay_names) for p in params])
            total = sum(p.numel() for p in params)
            m = torch.zeros(total, dtype=torch.float32, device=device)
            v = torch.zeros(total if self.second_moment else 1, dtype=torch.float32, device=device)
            offset = 0
            for p in params:
                n = p.numel()
                v_view = v[offset:offset + n].view_as(p) if self.second_moment else v[0].expand_as(p)
                self._views[id(p)] = (gname, m[offset:offset + n].view_as(p), v_view)
                self._decayed[id(p)] = names.get(id(p)) in decay_names
                offset += n
            self._groups.append((gname, params, decay, m, v))

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for gname, params, decay, m, v in self._groups:
            if all(id(p) in self._frozen for p in params) or any(p.grad is None for p in params):
                continue  # frozen, or no gradient this step (distillation's other blocks)
            flat = torch.cat([p.detach().reshape(-1).float() for p in params])
            grad = torch.cat([p.grad.reshape(-1).float() for p in params])
            self._steps[gname] = self._steps.get(gname, 0) + 1
            self.update_flat(flat, grad, m, v, lr=lr, step=self._steps[gname], decay=decay, group=gname)
            torch._foreach_copy_([p.data for p in params],
                                 [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params,
                                                               strict=True)])

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
# update each group's flat buffers in the walk; on autograd (one process or DDP) ``GroupedUpdates``
# gathers each group and calls the same ``update_flat``. Sharded state is refused (validate:
# apr/plan/orchestratefacts.py). Both keep their momentum in AdamW's first-moment buffer, so they
# need no memory AdamW does not already have.


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
    def update_flat(self, params: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, step: int, decay, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                    param_copy: torch.Tensor | None = None, group: str | None = None) -> None:
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
    def update_flat(self, params: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, step: int, decay, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                    param_copy: torch.Tensor | None = None, group: str | None = None) -> None:
        if found_inf is not None and bool(found_inf):
            return
        state = self.groups.setdefault(group or "", {"lam": 0.0, "switched_at": None, "sgd_lr": None,
                                                       "lr_at_switch": None})
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            grad.mul_(grad_scale)
        _decay(params, lr * self.weight_decay, decay)
        if state["switched_at"] is not None:
            exp_avg.mul_(self.beta1).add_(grad)
            rate = state["sgd_lr"] * (lr / state["lr_at_switch"] if state["lr_at_switch"] else 1.0)
            params.add_(exp_avg, alpha=-(1 - self.beta1) * rate)
        else:
            exp_avg.lerp_(grad, 1 - self.beta1)
            exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (exp_avg_sq / (1 - self.beta2 ** step)).sqrt_().add_(self.eps)
            p = exp_avg.div(denom).mul_(-lr / (1 - self.beta1 ** step))
            params.add_(p)
            pg, pp = float(torch.dot(p, grad)), float(torch.dot(p, p))
            if pg != 0.0:
                gamma = pp / -pg
                state["lam"] = self.beta2 * state["lam"] + (1 - self.beta2) * gamma
                corrected = state["lam"] / (1 - self.beta2 ** step)
                if step > self.min_steps and abs(corrected - gamma) < self.tolerance and corrected > 0:
                    state.update(switched_at=step, sgd_lr=corrected, lr_at_switch=lr)
                    exp_avg.zero_()  # SGD's momentum starts from zero (the paper's v_0)
        if param_copy is not None:
            param_copy.copy_(params)

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
    def update_flat(self, params: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, step: int, decay, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                    param_copy: torch.Tensor | None = None, group: str | None = None) -> None:
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
        self.update_sq[group or ""] = torch.dot(direction, direction) * rate * rate
        if isinstance(rate, torch.Tensor):
            params.sub_(direction.mul_(rate))
        else:
            params.sub_(direction, alpha=rate)
        exp_avg.lerp_(grad, 1 - self.beta2)
        if param_copy is not None:
            param_copy.copy_(params)

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

    def update_flat(self, *args, **kwargs) -> None:
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
