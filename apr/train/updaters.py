"""The updater part of the composed engine (docs/design.md, "The composed engine"): what turns a
finished gradient into new weights, apart from where the gradient came from.

``AdamW`` is the one updater today. It updates in two ways, one per kind of gradient source:

- ``update_flat``: the kernel backend's fused AdamW (the CuPy RawKernel on CUDA, torch ops on the
  CPU) on flat float32 tensors, one optimizer group (the flat-buffer walk) or one local shard
  (the walk under FSDP2) at a time, as soon as its gradient is complete;
- ``bind`` then ``step``: ``torch.optim.AdamW`` (fused on CUDA) over named parameters in two
  weight-decay groups, after a whole autograd backward (one process, DDP, FSDP2's DTensors).

Its moments are ``exp_avg`` / ``exp_avg_sq`` (checkpointed as ``optimizer.m.`` / ``optimizer.v.``):
in the buffer plan's flat buffers for the walk, in ``torch.optim.AdamW``'s per-parameter state for
the autograd sources and the sharded walk (``moments`` / ``set_moments``). Another optimizer (SGD,
SWATS) is another class with these methods; the engines call nothing else.
"""

from __future__ import annotations

import torch

from apr.config.schema import OptimizerConfig
from apr.kernels import KernelBackend


class AdamW:
    name = "adamw"

    def __init__(self, opt: OptimizerConfig, backend: KernelBackend):
        self.lr = opt.lr
        self.beta1, self.beta2, self.eps, self.weight_decay = opt.beta1, opt.beta2, opt.eps, opt.weight_decay
        self.backend = backend
        self.optimizer: torch.optim.AdamW | None = None  # after ``bind``

    # ------------------------------------------------------------------ flat tensors, one group at a time

    def update_flat(self, params: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, step: int, decay, grad_scale=1.0, found_inf: torch.Tensor | None = None,
                    param_copy: torch.Tensor | None = None) -> None:
        """One fused AdamW update of flat float32 tensors in place; ``decay``: the ranges weight decay
        applies to; ``grad_scale`` multiplies the gradient first (clip coefficient, 1/loss scale);
        ``found_inf`` (a device flag) makes it write nothing; ``param_copy`` receives the new weights
        in the compute dtype."""
        self.backend.adamw_step(params, grad, exp_avg, exp_avg_sq, lr=lr, beta1=self.beta1, beta2=self.beta2,
                                eps=self.eps, weight_decay=self.weight_decay, step=step, decay=decay,
                                grad_scale=grad_scale, found_inf=found_inf, param_copy=param_copy)

    # ------------------------------------------------------------------ named parameters, after a backward

    def bind(self, named: dict[str, torch.Tensor], decay_names: set[str], device: torch.device) -> None:
        """Hold torch's AdamW over these parameters: decayed ones, then the rest without decay."""
        params = list(named.items())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in params if n in decay_names], "weight_decay": self.weight_decay},
             {"params": [p for n, p in params if n not in decay_names], "weight_decay": 0.0}],
            lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps, fused=(device.type == "cuda") or None,
        )

    def step(self, lr: float) -> None:
        for pg in self.optimizer.param_groups:
            pg["lr"] = lr
        self.optimizer.step()

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
