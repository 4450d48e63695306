"""The flat-buffer block walk: a gradient source of the engine (apr/train/engine.py; docs/design.md,
"The engines" and "Execution policy").

The backward walks from the LM head to the embedding one block at a time, backpropagating into the
block's gradient buffer and running the updater over that block's flat buffers as soon as its
gradient is complete. The resolved execution policy (apr/steps/execution.py, chosen by the plan)
says, per block, whether the forward keeps the block's autograd graph (``keep``), keeps only its
matmul and attention outputs (``selective``: norms, activations and rope are recomputed) or only its
input (``recompute``); and whether gradients go to one shared workspace or stay kept for the whole
step. ``apr.steps.strategy`` says when a norm-only walk comes first (exact global clipping or the
fp16 overflow check with one workspace). Under DDP each group's gradient is all-reduced while the
next group's backward runs (two workspaces in flight).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from apr.checkpoint import names
from apr.kernels.linear_ce import linear_cross_entropy_fwd_bwd
from apr.memory import buffers as planned_buffers
from apr.train.backprop import backward
from apr.train.engine import group_specs, sac_policy, selectively
from apr.train.flat import FlatGroup, flatten_group
from apr.train.nonfinite import LOSS
from apr.train.reduction import CanonicalSum
from apr.train.updaters import Piece


class Walk:
    """The flat-buffer walk (see the module docstring): the causal-LM loss fused into its head step."""

    name = "interleaved"
    declares = staticmethod(planned_buffers.walk_buffers)  # allocated from this list (build.allocate_buffers)

    def __init__(self, engine, buffers: dict[str, torch.Tensor]):
        self.e = engine  # apr/train/engine.py: the settings, precision, updater and step decisions
        plan, model = engine.plan, engine.model
        config = plan.config
        self.buffers = buffers  # the buffer plan's tensors by name (measured by apr/probe.py)
        self.groups: list[FlatGroup] = [
            flatten_group(model, name, specs, buffers[f"{name}.flat_params"], buffers[f"{name}.adam_m"],
                          buffers[f"{name}.adam_v"], buffers.get(f"{name}.grad"))
            for name, specs in group_specs(config)
        ]
        if config.model.lora is None:
            self.embed, self.block_groups, self.head = self.groups[0], self.groups[1:-1], self.groups[-1]
        else:  # LoRA: the embedding and the head are frozen; each block's group holds its adapters
            self.embed, self.block_groups, self.head = None, self.groups, None
        self.workspace = buffers.get("grad_workspace")
        # Under data parallelism a second workspace lets one group's all-reduce run while the next
        # group's backward fills the other (at most two gradient buffers in flight).
        self._workspaces = [w for w in (self.workspace, buffers.get("grad_workspace_1")) if w is not None]
        self._next_ws = 0
        self._inflight: tuple | None = None
        self.grad_scratch = buffers.get("grad_scratch")
        # training.reduction: canonical (apr/train/reduction.py): every micro-batch walked into the kept
        # buffers alone, taken as a leaf of its own and summed in the fixed tree over the global batch
        self.canonical = CanonicalSum(engine.dp) if engine.plan.reduction == "canonical" else None
        self.tied = model.lm_head is None and self.embed is not None
        # LoRA or model dropout: each block's RNG state at its forward, replayed when the block is recomputed
        lora = config.model.lora
        dropout = (lora is not None and lora.dropout > 0) or config.model.architecture.dropout > 0
        self._block_rng: list | None = [None] * len(self.block_groups) if dropout else None
        self._lr = 0.0
        # The compute copy (docs/design.md, "The engines"): each block's weights in bf16/fp16,
        # written by AdamW's param_copy after every update; the blocks' matmuls read it instead of
        # autocast re-casting the fp32 masters in every forward and recompute.
        self._matmul_params: list[list[tuple[str, int]]] = []
        if planned_buffers.uses_compute_copy(config, self.e.execution):
            for i, g in enumerate(self.block_groups):
                g.compute = buffers[f"{g.name}.compute"]
                prefix = f"model.layers.{i}."
                self._matmul_params.append([(s.name.removeprefix(prefix), k) for k, s in enumerate(g.specs)
                                            if len(s.shape) == 2])
            self._refresh_compute()

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of each allocated buffer-plan tensor, by buffer name."""
        return {name: t.untyped_storage().nbytes() for name, t in self.buffers.items()}

    # ---------------------------------------------------------------- forward and the backward walk

    def _forward(self, ids: torch.Tensor) -> tuple[list[torch.Tensor | None], list[tuple | None]]:
        """Each block's input (in the compute dtype) and the last block's output; and, for each block
        the policy keeps (``keep`` or ``selective``), its ``(input, output)`` autograd graph."""
        cos, sin = self.e.model.rope(ids.shape[1], ids.device)
        graphs: list[tuple | None] = []
        with self.e.autocast():
            with torch.no_grad():
                x = self.e.model.model.embed_tokens(ids).to(self.e.cdt)
            inputs: list[torch.Tensor | None] = [x]
            for i in range(len(self.e.model.model.layers)):
                mode = self.e.execution.block_mode(i)
                if self._block_rng is not None:  # dropout: a recompute must draw the same masks
                    self._block_rng[i] = _rng_state(ids.device)
                if mode == "recompute":
                    with torch.no_grad():
                        x = self._run_block(i, x, cos, sin)[0].to(self.e.cdt)
                    graphs.append(None)
                else:
                    x_in = x.detach().requires_grad_()
                    with torch.enable_grad():
                        out, leaves = self._run_block(i, x_in, cos, sin, selective=mode == "selective")
                        out = out.to(self.e.cdt)
                    graphs.append((x_in, out, leaves))
                    x = out.detach()
                inputs.append(x)
        return inputs, graphs

    def _run_block(self, i: int, x, cos, sin, selective: bool = False) -> tuple[torch.Tensor, list]:
        """Block ``i``'s forward; with a compute copy its matmul weights are leaves over that copy
        (returned, for ``_add_compute_grads``), else the fp32 parameters autocast casts."""
        layer = self.e.model.model.layers[i]
        if not self._matmul_params:
            return (selectively(layer, x, cos, sin) if selective else layer(x, cos, sin)), []
        views = self.block_groups[i].views(self.block_groups[i].compute)
        grad = torch.is_grad_enabled()
        leaves = [(k, views[k].detach().requires_grad_(grad)) for _, k in self._matmul_params[i]]
        weights = {name: leaf for (name, _), (_, leaf) in zip(self._matmul_params[i], leaves, strict=True)}

        def run(x_, cos_, sin_):
            return torch.func.functional_call(layer, weights, (x_, cos_, sin_))

        if selective:
            out = checkpoint(run, x, cos, sin, use_reentrant=False,
                             context_fn=partial(create_selective_checkpoint_contexts, sac_policy))
        else:
            out = run(x, cos, sin)
        return out, leaves if grad else []

    @staticmethod
    def _add_compute_grads(group: FlatGroup, leaves: list) -> None:
        """Add the compute-dtype weights' gradients into the fp32 gradient buffer, as autograd adds a
        cast weight's gradient into its fp32 parameter (the same float32 additions: bitwise equal)."""
        for k, leaf in leaves:
            if leaf.grad is not None:
                group.params[k].grad.add_(leaf.grad)
                leaf.grad = None

    @torch.no_grad()
    def _refresh_compute(self) -> None:
        """Derive the compute copies from the fp32 masters (at build and after a checkpoint load)."""
        for g in self.block_groups:
            if g.compute is not None:
                g.compute.copy_(g.flat_params)

    def _grad_buffer(self, group: FlatGroup) -> torch.Tensor:
        """Bind the group's gradients: to its own buffer, or to the zeroed shared workspace."""
        if group.own_grad is not None:
            buf = group.own_grad
        else:
            buf = self._workspaces[self._next_ws][: group.numel]
            if self._overlapping:
                self._next_ws = (self._next_ws + 1) % len(self._workspaces)
            buf.zero_()
        group.bind_grads(buf)
        return buf

    @property
    def _overlapping(self) -> bool:
        return self.e.dp is not None and not self.e.strategy.keeps_all_grads

    def _done(self, group: FlatGroup, buf: torch.Tensor, on_done) -> None:
        self.e._probe(group.name)
        if self._overlapping:
            # start averaging this group's gradient over the ranks, then finish the previous group
            handle = self.e.dp.all_reduce_sum_async(buf)
            previous, self._inflight = self._inflight, (group, buf, handle, on_done)
            if previous is not None:
                self._finish(previous)
            return
        on_done(group, buf)
        if not self.e.strategy.keeps_all_grads:
            group.release_grads()  # the workspace now belongs to the next group

    def _finish(self, item: tuple) -> None:
        group, buf, handle, on_done = item
        handle.wait()
        buf.div_(self.e.dp.world_size)
        on_done(group, buf)
        group.release_grads()

    def _drain(self) -> None:
        if self._inflight is not None:
            item, self._inflight = self._inflight, None
            self._finish(item)
        self._next_ws = 0

    def _walk(self, ids, targets, inputs, graphs, grad_mult: float, on_done, free_inputs: bool,
              check_loss: bool = True, accumulate: bool = False, gate_loss: bool = False) -> torch.Tensor:
        """Backward from the loss to the embedding; ``on_done(group, grad)`` runs as soon as each
        group's gradient is complete. Returns the loss sum (flagged if non-finite before any ``on_done``).
        ``free_inputs``: the last walk over this forward (kept graphs are released as it goes);
        ``accumulate``: kept gradient buffers already hold earlier micro-batches.

        The gradient is that of ``grad_mult * mean loss`` (loss scale / micro-batches), formed in the
        same order of float operations as autograd in the standard engine, so both agree bitwise.
        """
        if not self.e.strategy.keeps_all_grads:
            for g in self.groups:
                if g.own_grad is not None:  # a tied embedding's buffer: fresh for every walk
                    g.own_grad.zero_()
        loss_sum, grad_x = self._walk_head(targets, inputs, grad_mult, on_done, free_inputs, check_loss, accumulate,
                                           gate_loss)
        grad_x = self._walk_blocks(ids, inputs, graphs, grad_x, on_done, free_inputs)
        if self.embed is not None:  # LoRA: a frozen embedding needs no gradient
            self._walk_embedding(ids, grad_x, on_done, accumulate)
        self._drain()
        return loss_sum

    def _walk_head(self, targets, inputs, grad_mult: float, on_done, free_inputs: bool, check_loss: bool,
                   accumulate: bool, gate_loss: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm, LM head and cross-entropy, chunk by chunk: the loss sum and the gradient of the
        last block's output."""
        model, n_layers, kept = self.e.model, len(self.block_groups), accumulate
        if self.tied:
            self._grad_buffer(self.embed)  # the head's weight gradient adds into the embedding's
        frozen_head = self.head is None  # LoRA: only the hidden states' gradient is needed
        head_buf = None if frozen_head else self._grad_buffer(self.head)
        weight = model.head_weight
        # Where the head weight's gradient is formed: straight into its (zeroed) buffer, or, when that
        # already holds earlier micro-batches, in the scratch and then added.
        head_grad = None if frozen_head else self._scratch(weight.shape) if kept else weight.grad
        h_in = inputs[n_layers].detach().requires_grad_()
        with self.e.autocast():
            h = model.model.norm(h_in)
        loss_sum, grad_h = linear_cross_entropy_fwd_bwd(
            h, weight, targets, chunk_size=self.e.chunk_size, grad_scale=1.0 / targets.numel(),
            backend=self.e.backend, grad_weight=head_grad, compute_dtype=self.e.cdt,
        )
        if check_loss:  # before any update; the stepping walk after a norm pre-pass already knows the loss
            if self.e.scaler.enabled:
                self.e._check_loss(loss_sum)
            else:
                self.e._flags.flag(~torch.isfinite(loss_sum), LOSS, self.e.calls)
        if gate_loss:  # the one-walk step: the loss test, before the head's update
            self.e._gate(loss_sum / targets.numel(), None)
        if grad_mult != 1.0:
            grad_h.mul_(grad_mult)
            if head_grad is not None:
                head_grad.mul_(grad_mult)
        if kept and head_grad is not None:
            weight.grad.add_(head_grad)
        backward(h, grad_h)
        grad_x = h_in.grad
        del h, h_in, grad_h, head_grad
        if free_inputs:
            inputs[n_layers] = None
        if head_buf is not None:
            self._done(self.head, head_buf, on_done)
        return loss_sum, grad_x

    def _walk_blocks(self, ids, inputs, graphs, grad_x: torch.Tensor, on_done, free_inputs: bool) -> torch.Tensor:
        """Blocks, last to first: backprop through the kept graph (or recompute it from the saved input),
        hand over; returns the gradient of the embedding's output."""
        cos, sin = self.e.model.rope(ids.shape[1], ids.device)
        for i in reversed(range(len(self.block_groups))):
            group = self.block_groups[i]
            buf = self._grad_buffer(group)
            # a selective graph can be backpropagated once only: the norm-only walk recomputes it
            if graphs[i] is not None and (free_inputs or self.e.execution.block_mode(i) == "keep"):
                x, out, leaves = graphs[i]
                x.grad = None
                backward(out, grad_x, retain_graph=not free_inputs)
            else:
                x = inputs[i].detach().requires_grad_()
                with self.e.autocast(), _replayed_rng(self._block_rng[i] if self._block_rng else None, ids.device):
                    out, leaves = self._run_block(i, x, cos, sin)
                    out = out.to(self.e.cdt)
                backward(out, grad_x)
            self._add_compute_grads(group, leaves)
            grad_x = x.grad
            x.grad = None
            del out, x
            if free_inputs:
                inputs[i] = graphs[i] = None
            self._done(group, buf, on_done)
        return grad_x

    def _walk_embedding(self, ids, grad_x: torch.Tensor, on_done, accumulate: bool) -> None:
        """Scatter the input gradient into the embedding rows looked up (no dense autograd temporary)."""
        buf = self._grad_buffer(self.embed)
        embed_grad = self.embed.params[0].grad
        fresh = not (accumulate or self.tied)  # the buffer was just zeroed and holds nothing else
        lookup_grad = embed_grad if fresh else self._scratch(embed_grad.shape)
        lookup_grad.index_add_(0, ids.reshape(-1), grad_x.reshape(-1, grad_x.shape[-1]).to(lookup_grad.dtype))
        if not fresh:
            embed_grad.add_(lookup_grad)
        self._done(self.embed, buf, on_done)

    def _scratch(self, shape) -> torch.Tensor:
        """A zeroed float32 scratch of ``shape``: the accumulation scratch, else the free workspace."""
        n = shape[0] * shape[1]
        # without a scratch: the workspace that is neither bound nor in flight
        buf = (self.grad_scratch if self.grad_scratch is not None else self._workspaces[self._next_ws])[:n]
        return buf.zero_().view(shape)

    # --------------------------------------------------------------------------------- stepping

    def _apply(self, group: FlatGroup, grad: torch.Tensor, coef) -> None:
        found_inf = self.e._flags.bad  # set by a non-finite loss or gradient in this step or an earlier one
        if self.e.strategy.clip == "adagc":
            self.e._adagc_clip(group.name, group.views(grad), 1.0 / self.e.scaler.scale, found_inf)
        scale = coef if self.e.scaler.scale == 1.0 else coef * (1.0 / self.e.scaler.scale)
        if group.name in self.e.frozen:  # progressive stacking's frozen blocks: no update at all
            return
        piece = Piece(group.flat_params, grad, group.exp_avg, group.exp_avg_sq, group.decay, group.compute)
        self.e.updater.update_group(group.name, [piece], lr=self._lr, step=self.e.optimizer_steps + 1,
                                    grad_scale=scale, found_inf=found_inf)
        self.e._flags.stepped()

    # The source's side of ``Engine.train_step`` (apr/train/engine.py), the step ended by apr/train/finish.py.
    holds_all_grads = False  # only when the strategy keeps them (accumulation, or asked)
    reads_host = False  # a non-finite norm is a device flag (fp16 aside)

    @property
    def sq_scale(self) -> float:
        """The walk's group norms are of the loss-scaled gradients."""
        return self.e.scaler.scale

    def accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Kept gradients: every group keeps its gradient across the step's micro-batches (one backward
        walk each), averaged over the ranks; returns the mean loss and each group's squared norm."""
        if self.canonical is not None:
            return self._canonical_accumulate(micro_batches)
        for g in self.groups:
            g.own_grad.zero_()
        loss = torch.zeros((), device=self.e.device)
        accum = len(micro_batches)
        for k, batch in enumerate(micro_batches):
            ids, targets = self.e.split(batch)
            inputs, graphs = self._forward(ids)
            loss_sum = self._walk(ids, targets, inputs, graphs, self.e.scaler.scale / accum, lambda g, buf: None,
                                  free_inputs=True, accumulate=k > 0)
            loss += loss_sum / (targets.numel() * accum)
        if self.e.dp is not None:  # average the accumulated gradients over the ranks, all groups at once
            for handle in [self.e.dp.all_reduce_sum_async(g.own_grad) for g in self.groups]:
                handle.wait()
            for g in self.groups:
                g.own_grad.div_(self.e.dp.world_size)
        return loss, {g.name: self.e.backend.sq_norm(g.own_grad) for g in self.groups}

    def _canonical_accumulate(self, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``training.reduction: canonical``: each micro-batch walked alone into the zeroed kept buffers
        (the gradient of its loss times the loss scale), copied into a leaf of its own; the leaves of
        every rank summed in the fixed tree over the global micro-batch index and divided by their
        number (``CanonicalSum``), and the mean written back into the kept buffers, still loss-scaled
        as the walk's norms and updates expect. The same float operations whatever the world size."""
        for batch in micro_batches:
            for g in self.groups:
                g.own_grad.zero_()
            ids, targets = self.e.split(batch)
            inputs, graphs = self._forward(ids)
            loss_sum = self._walk(ids, targets, inputs, graphs, self.e.scaler.scale, lambda g, buf: None,
                                  free_inputs=True)
            self.canonical.take([g.own_grad for g in self.groups], loss_sum / targets.numel())
        flat, loss = self.canonical.reduce()
        offset = 0
        for g in self.groups:
            g.own_grad.copy_(flat[offset:offset + g.own_grad.numel()].view_as(g.own_grad))
            offset += g.own_grad.numel()
        return loss, {g.name: self.e.backend.sq_norm(g.own_grad) for g in self.groups}

    def apply_all(self, coefs: dict, *, lr: float, loss: torch.Tensor) -> None:
        self._lr = lr
        for g in self.groups:
            self._apply(g, g.own_grad, coefs[g.name])

    def release(self) -> None:
        for g in self.groups:
            g.release_grads()

    def forward(self, batch: torch.Tensor) -> tuple:
        """One micro-batch's forward (the block inputs and kept graphs the walks read)."""
        ids, targets = self.e.split(batch)
        return (ids, targets, *self._forward(ids))

    def norms(self, one_pass: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The norm-only walk (exact global clipping or the fp16 overflow check in O(one block) of
        gradient memory): each group's squared norm, its gradient dropped; the forward kept."""
        ids, targets, inputs, graphs = one_pass
        sq: dict[str, torch.Tensor] = {}

        def record(g: FlatGroup, buf: torch.Tensor) -> None:
            sq[g.name] = self.e.backend.sq_norm(buf)

        loss_sum = self._walk(ids, targets, inputs, graphs, self.e.scaler.scale, record, free_inputs=False)
        return loss_sum / targets.numel(), sq

    def step_pass(self, one_pass: tuple, coefs: dict, *, lr: float) -> None:
        """The stepping walk over the same forward, each group updated with its coefficient."""
        ids, targets, inputs, graphs = one_pass
        self._lr = lr
        self._walk(ids, targets, inputs, graphs, self.e.scaler.scale,
                   lambda g, buf: self._apply(g, buf, coefs[g.name]), free_inputs=True, check_loss=False)

    def stream(self, one_pass: tuple, coef_of, *, lr: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One walk, each group updated as soon as its gradient is complete (``coef_of``: its clipping
        coefficient from its squared norm, None to skip it)."""
        ids, targets, inputs, graphs = one_pass
        self._lr = lr
        sq: dict[str, torch.Tensor] = {}

        def step(g: FlatGroup, buf: torch.Tensor) -> None:
            sq[g.name] = self.e.backend.sq_norm(buf)
            coef = coef_of(sq[g.name])
            if coef is not None:
                self._apply(g, buf, coef)

        loss_sum = self._walk(ids, targets, inputs, graphs, 1.0, step, free_inputs=True,
                              gate_loss=self.e.step_gate is not None)
        return loss_sum / targets.numel(), sq

    # ------------------------------------------------------------------------------------ state

    def train_state_tensors(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Weights under HF names and AdamW moments as ``optimizer.m.<name>`` / ``optimizer.v.<name>``
        (views of the device buffers; the checkpoint manager copies them)."""
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            ms, vs = g.views(g.exp_avg), g.views(g.exp_avg_sq)
            for s, p, m, v in zip(g.specs, g.params, ms, vs, strict=True):
                out[s.name] = p.detach()
                out[names.OPT_M + s.name] = m
                out[names.OPT_V + s.name] = v
        return out

    @torch.no_grad()
    def load_train_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.e._check_state_names(tensors)
        for name, dst in self.train_state_tensors().items():
            dst.copy_(tensors[name])
        self._refresh_compute()



    # ------------------------------------------------------------ what every source answers

    def freeze(self, frozen: set[str]) -> None:
        """Frozen groups are skipped in ``_apply`` (``engine.frozen``)."""

    def meta_state(self) -> dict:
        return {}

    def load_meta_state(self, meta: dict) -> None:
        pass


# --------------------------------------------------------------------------- dropout replay


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def _replayed_rng(state: tuple | None, device: torch.device):
    """Run with the RNG as it was at ``state`` (a block's forward), leaving the RNG as it was found,
    as torch.utils.checkpoint does: a recomputed block draws the dropout masks of its forward."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
