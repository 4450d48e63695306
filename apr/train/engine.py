"""The training engines.

``InterleavedEngine`` (docs/design.md, "The engines" and "Execution policy"): the backward walks from the LM head to the
embedding one block at a time, backpropagating into the block's gradient buffer and running AdamW
over that block's flat buffers as soon as its gradient is complete. The resolved execution policy
(apr/steps/execution.py, chosen by the plan) says, per block, whether the forward keeps the block's
autograd graph (``keep``), keeps only its matmul and attention outputs (``selective``: norms,
activations and rope are recomputed) or only its input (``recompute``); and whether gradients go to
one shared workspace or stay kept for the whole step. ``apr.steps.strategy`` says when a norm-only
walk comes first (exact global clipping or the fp16 overflow check with one workspace).

``StandardEngine``: the textbook loop (full autograd backward, ``clip_grad_norm_``,
``torch.optim.AdamW``) over the same model, loss and precision: the baseline and the reference the
interleaved engine is tested against.

Both take micro-batches of token ids ``[batch, seq_len + 1]`` and a learning rate, and return the
step's loss and gradient norm as device tensors. The interleaved engine reads nothing on the host
during a step (fp32/bf16): a non-finite loss or gradient sets a sticky flag on the device that every
later AdamW launch honours (``found_inf``: the step and all after it write nothing), and the caller
reads it with ``check_finite()`` when it reads the host anyway (log, evaluation, checkpoint). Under
fp16 the loss-scale decision needs one host read per step (the loss, then the norm), and the
standard engine, the textbook loop, reads the loss and the norm every step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from apr.checkpoint import names
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.kernels import KernelBackend
from apr.kernels.linear_ce import linear_cross_entropy_fwd_bwd
from apr.model import buffers as planned_buffers
from apr.model import spec
from apr.model.llama import LlamaForCausalLM
from apr.model.trunk import load_trunk_state, trunk_state
from apr.steps.resolved import Resolved
from apr.train.backprop import backward
from apr.train.dist import DataParallel
from apr.train.finish import finish_step
from apr.train.flat import FlatGroup, flatten_group
from apr.train.losses import CausalLM
from apr.train.nonfinite import GRADIENTS, LOSS, NonFiniteFlags
from apr.train.outcome import NonFiniteError, StepResult
from apr.train.precision import DynamicLossScaler, autocast, torch_dtype
from apr.train.updaters import make_updater

LOSS_GROUP = "loss"  # the optimizer group of the loss part's own parameters (``Engine.loss_parameters``)


def resolve_device(name: str) -> torch.device:
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise AprError("training.device: cuda requested but torch sees no CUDA device")
    return torch.device(name)


def group_specs(config: AprConfig) -> list[tuple[str, list[spec.ParamSpec]]]:
    """Optimizer groups in buffer-plan order: the embedding, each block, the final norm + head; with
    LoRA, each block's adapters only (frozen weights get no gradient buffer and no moments)."""
    return spec.optimizer_groups(config)


class Engine:
    """What every gradient source shares: settings, precision, the loss part, evaluation, clipping
    arithmetic, checkpoint metadata (docs/design.md, "The composed engine")."""

    source = "abstract"
    # the gradient source's own buffers (apr/model/buffers.py): what the plan's memory table sums for it
    declares: Callable = staticmethod(lambda config, execution=None: [])
    sharded = False  # state sharded over the ranks by FSDP2 (apr/train/sharded.py): checkpoints in parts

    def __init__(self, plan: Resolved, model: LlamaForCausalLM, device: torch.device, backend: KernelBackend,
                 loss: CausalLM | None = None):
        config = plan.config
        tr = config.training
        self.plan = plan  # the resolved plan this engine was built from (apr/steps/resolved.py)
        self.loss = loss or CausalLM()
        self.current_step = 1  # the run's step in progress (set by the run loop; losses may follow it)
        self.config = config
        self.model = model
        self.device = device
        self.backend = backend
        self.execution = plan.execution  # the plan's, never re-derived here (apr/train/build.py)
        self.strategy = plan.strategy
        self.cdt = torch_dtype(tr.mixed_precision)
        self.scaler = DynamicLossScaler(enabled=self.strategy.loss_scaling)
        self.chunk_size = tr.loss_chunk_size
        self.grad_clip = tr.grad_clip
        self.updater = make_updater(config.optimizer, backend)  # the update part (apr/train/updaters.py)
        if self.updater.name != "adamw" and self.sharded:
            raise AprError(f"optimizer.name {self.updater.name} updates whole optimizer groups; under "
                           "training.sharding each rank holds shards of them (see apr train validate)")
        self.optimizer_steps = 0  # updates applied (fp16 overflow steps are not counted)
        self.adagc = tr.adagc
        # AdaGC: per tensor, an EMA of its clipped gradient norm (float32, on the device), one vector
        # per group in buffer-plan order; checkpointed in the engine's metadata (``adagc_ema``).
        self.adagc_ema: dict[str, torch.Tensor] = {}
        if self.strategy.clip == "adagc":
            self.adagc_ema = {name: torch.zeros(len(specs), device=device) for name, specs in group_specs(config)}
        self.dp: DataParallel | None = None  # set by ``build_engine`` under torchrun
        self.base_ref: dict | None = None  # LoRA: {"init_from", "sha256"} of the frozen base (build_engine)
        self.frozen: set[str] = set()  # optimizer groups that get no update (progressive stacking, freeze)
        self.trunk_cache = None  # apr/train/trunk_cache.py TrunkCache, set by the run (cache_activations)
        self.calls = 0  # train_step calls
        self.group_names = [name for name, _ in group_specs(config)]  # buffer-plan order
        self._flags = NonFiniteFlags(device)
        # Test/diagnostic hook, called with a group name once that group's gradient is complete.
        self.grad_probe: Callable[[str], None] | None = None
        # Bad-step skipping (apr/train/badsteps.py): called with the step's mean loss and global
        # gradient norm (None where the norm is not known before the first update: the loss-only
        # test of a one-walk step) before any update; True skips the step. Set by the run loop.
        self.step_gate: Callable[[torch.Tensor, torch.Tensor | None], bool] | None = None
        self._skip = False
        # The last step's squared gradient norm per group (device tensors, times group_sq_scale**2 under
        # fp16) and the update count before it (the step updated the weights iff optimizer_steps is
        # larger now): kept, not read; apr/train/blocknorms.py reads them at log steps.
        self.group_sq: dict[str, torch.Tensor] = {}
        self.group_sq_scale = 1.0
        self.group_sq_steps = 0

    @property
    def kind(self) -> str:
        """``interleaved`` or ``standard`` (the gradient source), or the loss's own (``distill``)."""
        return self.loss.kind or self.source

    def hidden_states(self, lm: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """The embedding and the blocks (the last block's output), as the loss parts read them."""
        if self.trunk_cache is not None:  # model.stacking.cache_activations: the trunk's rows from disk
            return self.trunk_cache.hidden(lm, ids, self.cdt)
        if self.source == "standard" and self.execution.recomputed_blocks and torch.is_grad_enabled():
            return self._hidden_recomputed(lm, ids)
        return lm.hidden_states(ids, self.cdt)

    def _hidden_recomputed(self, lm: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """``lm.hidden_states`` under the execution policy on autograd (plain, FSDP2, a distillation
        student, a transformed stacking trunk): a ``recompute`` block keeps only its input and runs
        again in the backward, a ``selective`` one keeps its matmul and attention outputs
        (docs/design.md, "Execution policy"); ``keep`` blocks as they are."""
        cos, sin = lm.rope(ids.shape[1], ids.device)
        x = lm.model.embed_tokens(ids).to(self.cdt)
        for i, layer in enumerate(lm.model.layers):
            mode = self.execution.block_mode(i)
            if mode == "recompute":
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            elif mode == "selective":
                x = _selective(layer, x, cos, sin)
            else:
                x = layer(x, cos, sin)
            x = x.to(self.cdt)
        return x

    def whole_weights(self):
        """A context in which ``self.model`` holds its whole weights (evaluation, samples): as it is
        here; sharded engines gather them on every rank for its duration."""
        return nullcontext()

    def tensor_norms(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Each gradient tensor's norm for AdaGC when ``grads`` are shards (None: computed locally)."""
        return None

    def _gate(self, loss: torch.Tensor, norm: torch.Tensor | None) -> bool:
        """Ask ``step_gate`` once per step (a host read: the gate reads the figures it tests)."""
        if self.step_gate is not None and not self._skip:
            self._skip = bool(self.step_gate(loss, norm))
        return self._skip

    def _keep_sq(self, sq: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        """Called in every step before its update (or its skip) is decided."""
        self.group_sq, self.group_sq_scale, self.group_sq_steps = sq, scale, self.optimizer_steps

    def autocast(self):
        return autocast(self.device, self.cdt)

    def split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    @torch.no_grad()
    def eval_loss_sum(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy over a batch (device tensor) and the number of tokens it covers."""
        ids, targets = self.split(batch)
        with self.autocast():
            hidden = self.hidden_states(self.model, ids)
        loss = self.model.loss(hidden, targets, chunk_size=self.chunk_size, backend=self.backend,
                               compute_dtype=self.cdt, norm_context=self.autocast(), total=True)
        return loss, targets.numel()

    def _check_loss(self, loss: torch.Tensor) -> None:
        """A host read: the standard engine and fp16 (whose loss scale decides on the host)."""
        if not bool(torch.isfinite(loss).item()):
            raise NonFiniteError("loss", state_is_last_good=True)

    def check_finite(self) -> None:
        """Raise ``NonFiniteError`` if a step since the last check had a non-finite loss or gradient;
        one host read. The steps from the first bad one on wrote nothing (``optimizer_steps`` is
        rolled back to match), so the weights are the last good ones unless a bad gradient
        appeared after some group of its step had already been updated."""
        found = self._flags.read(self.calls)
        if found is None:
            return
        what, steps_back, partial = found
        self.optimizer_steps -= steps_back
        raise NonFiniteError(what, state_is_last_good=not partial, steps_back=steps_back)

    def _clip_coef(self, norm: torch.Tensor) -> torch.Tensor:
        # exactly torch.nn.utils.clip_grad_norm_'s coefficient
        return torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)

    @torch.no_grad()
    def _adagc_clip(self, name: str, grads: list[torch.Tensor], unscale: float = 1.0,
                    found_inf: torch.Tensor | None = None, norms: torch.Tensor | None = None) -> None:
        """AdaGC (adaptive per-tensor clipping) of one group's gradients, in place and on the device.

        Each tensor's norm n (``unscale`` removes the fp16 loss scale) is clipped to ``grad_clip``
        during ``adagc.warmup_steps`` and to ``threshold x ema`` after; the EMA of the clipped norm
        follows with decay ``beta`` (started at the first step's clipped norm). A non-finite norm, or
        a step ``found_inf`` flags, leaves the EMA as it was. Local to the tensor, so it fits the
        one-group walk. ``norms``: the tensors' norms when ``grads`` are shards of them (sharding)."""
        ema, cfg = self.adagc_ema[name], self.adagc
        step = self.optimizer_steps + 1
        if norms is None:
            norms = torch.stack(torch._foreach_norm(grads)).float()
        if unscale != 1.0:
            norms = norms * unscale
        limit = ema * cfg.threshold if step > cfg.warmup_steps else torch.full_like(ema, self.grad_clip)
        coef = torch.clamp(limit / (norms + 1e-6), max=1.0)
        clipped = norms * coef
        new = clipped if step == 1 else ema * cfg.beta + clipped * (1.0 - cfg.beta)
        keep = torch.isfinite(new) if found_inf is None else torch.isfinite(new) & ~found_inf
        ema.copy_(torch.where(keep, new, ema))
        torch._foreach_mul_(grads, list(coef.to(grads[0].dtype).unbind()))

    def _coefs(self, sq_norms: dict[str, torch.Tensor], norm: torch.Tensor,
               sq_scale: float | None = None) -> dict[str, torch.Tensor | float]:
        """Each group's clipping coefficient by ``training.clip_mode``: the one dispatch every
        gradient source uses. ``sq_scale``: the loss scale still in ``sq_norms`` (default the
        scaler's: the walk's norms are of scaled gradients; autograd's are unscaled, 1.0)."""
        clip = self.strategy.clip
        if clip in ("off", "adagc"):  # adagc: per tensor (``_adagc_clip``)
            return {name: 1.0 for name in sq_norms}
        if clip == "global":
            coef = self._clip_coef(norm)
            return {name: coef for name in sq_norms}
        scale = self.scaler.scale if sq_scale is None else sq_scale
        return {name: self._clip_coef(sq.sqrt() / scale) for name, sq in sq_norms.items()}

    def _known_norm(self, sq_norms: dict[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """Global norm from complete per-group squared norms, checked before any update: on the
        device (a non-finite norm flags the step), or under fp16 on the host. Returns (norm,
        overflowed); an fp16 overflow is a skipped step, anything else non-finite stops."""
        norm = torch.stack([sq_norms[name] for name in self.group_names]).sum().sqrt() / self.scaler.scale
        if not self.scaler.enabled:
            self._flags.flag(~torch.isfinite(norm), GRADIENTS, self.calls)
            return norm, False
        if bool(torch.isfinite(norm).item()):
            return norm, False
        if self.scaler.enabled:
            self.scaler.update(found_inf=True)
            return norm, True
        raise NonFiniteError("gradients", state_is_last_good=True)

    def _probe(self, name: str) -> None:
        if self.grad_probe is not None:
            self.grad_probe(name)

    def meta_state(self) -> dict:
        meta = {"engine": self.kind, "optimizer_steps": self.optimizer_steps, "loss_scaler": self.scaler.state_dict()}
        loss_state = self.loss.state_dict()
        if loss_state is not None:
            meta.update(loss_state)
        if self.base_ref is not None:  # LoRA: the checkpoint holds adapters; this names their base
            meta["base"] = dict(self.base_ref)
        if self.adagc_ema:  # a few floats per tensor; float32 -> JSON float -> float32 is exact
            meta["adagc_ema"] = {name: ema.tolist() for name, ema in self.adagc_ema.items()}
        meta.update(self.updater.state_dict())  # SWATS: each group's phase and estimate
        return meta

    def loss_parameters(self) -> dict[str, torch.Tensor]:
        """The loss part's own trained parameters by checkpoint name (``names.LOSS_PREFIX``: a
        narrower distillation student's projections), none for the causal LM."""
        extra = getattr(self.loss, "extra_parameters", None)
        return dict(extra()) if extra is not None else {}

    def loss_tensor_shapes(self) -> dict[str, list[int]]:
        """What a checkpoint's JSON lists under ``loss_tensors`` (``names.loss_state_shapes``)."""
        return {n: list(p.shape) for n, p in self.loss_parameters().items()}

    def freeze(self, groups: set[str]) -> None:
        """Give these optimizer groups (``block.<i>``) no update: their gradients still flow to the
        blocks below, their weights and moments stay as they are (progressive stacking)."""
        self.frozen = set(groups)

    def load_meta_state(self, meta: dict) -> None:
        saved_base = meta.get("base")
        if self.base_ref is not None and saved_base is not None and saved_base.get("sha256") != self.base_ref["sha256"]:
            raise AprError(f"the checkpoint's adapters were trained on base weights with SHA-256 "
                           f"{saved_base.get('sha256')} ({saved_base.get('init_from')}), but model.init_from "
                           f"{self.base_ref['init_from']} has {self.base_ref['sha256']}: point init_from at the "
                           "original base")
        self.optimizer_steps = int(meta["optimizer_steps"])
        self.updater.load_state_dict(meta)
        self.scaler.load_state_dict(meta["loss_scaler"])
        self.loss.load_state_dict(meta)
        if self.adagc_ema:
            saved = meta.get("adagc_ema")
            if saved is None:
                raise AprError("the checkpoint has no AdaGC state (it was saved with another clip_mode)")
            for name, ema in self.adagc_ema.items():
                ema.copy_(torch.tensor(saved[name], dtype=torch.float32))

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        raise NotImplementedError

    def train_state_tensors(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Weights and AdamW moments under checkpoint names (``everywhere``: on every rank, not only
        the one that writes; a sharded engine gathers them)."""
        raise NotImplementedError

    def load_train_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _check_state_names(self, tensors: dict[str, torch.Tensor]) -> None:
        want = names.state_shapes((s.name, s.shape) for _, specs in group_specs(self.config) for s in specs)
        want.update((n, tuple(s)) for n, s in spec.trunk_specs(self.config))  # a stacking trunk: no moments
        want.update(names.state_shapes((n, tuple(p.shape)) for n, p in self.loss_parameters().items()))
        problems = names.torch_mismatches(tensors, want)
        if problems:
            raise AprError("checkpoint tensors do not match the model: " + "; ".join(problems[:5]))


class InterleavedEngine(Engine):
    """The flat-buffer walk (see the module docstring): the causal-LM loss fused into its head step."""

    source = "interleaved"
    declares = staticmethod(planned_buffers.walk_buffers)  # allocated from this list (build.allocate_buffers)

    def __init__(self, plan: Resolved, model: LlamaForCausalLM, device: torch.device, backend: KernelBackend,
                 buffers: dict[str, torch.Tensor]):
        super().__init__(plan, model, device, backend)
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
        self.tied = model.lm_head is None and self.embed is not None
        # LoRA dropout: each block's RNG state at its forward, replayed when the block is recomputed
        lora = config.model.lora
        self._block_rng: list | None = [None] * len(self.block_groups) if lora and lora.dropout > 0 else None
        self._lr = 0.0
        # The compute copy (docs/design.md, "The engines"): each block's weights in bf16/fp16,
        # written by AdamW's param_copy after every update; the blocks' matmuls read it instead of
        # autocast re-casting the fp32 masters in every forward and recompute.
        self._matmul_params: list[list[tuple[str, int]]] = []
        if planned_buffers.uses_compute_copy(config, self.execution):
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
        cos, sin = self.model.rope(ids.shape[1], ids.device)
        graphs: list[tuple | None] = []
        with self.autocast():
            with torch.no_grad():
                x = self.model.model.embed_tokens(ids).to(self.cdt)
            inputs: list[torch.Tensor | None] = [x]
            for i in range(len(self.model.model.layers)):
                mode = self.execution.block_mode(i)
                if self._block_rng is not None:  # LoRA dropout: a recompute must draw the same masks
                    self._block_rng[i] = _rng_state(ids.device)
                if mode == "recompute":
                    with torch.no_grad():
                        x = self._run_block(i, x, cos, sin)[0].to(self.cdt)
                    graphs.append(None)
                else:
                    x_in = x.detach().requires_grad_()
                    with torch.enable_grad():
                        out, leaves = self._run_block(i, x_in, cos, sin, selective=mode == "selective")
                        out = out.to(self.cdt)
                    graphs.append((x_in, out, leaves))
                    x = out.detach()
                inputs.append(x)
        return inputs, graphs

    def _run_block(self, i: int, x, cos, sin, selective: bool = False) -> tuple[torch.Tensor, list]:
        """Block ``i``'s forward; with a compute copy its matmul weights are leaves over that copy
        (returned, for ``_add_compute_grads``), else the fp32 parameters autocast casts."""
        layer = self.model.model.layers[i]
        if not self._matmul_params:
            return (_selective(layer, x, cos, sin) if selective else layer(x, cos, sin)), []
        views = self.block_groups[i].views(self.block_groups[i].compute)
        grad = torch.is_grad_enabled()
        leaves = [(k, views[k].detach().requires_grad_(grad)) for _, k in self._matmul_params[i]]
        weights = {name: leaf for (name, _), (_, leaf) in zip(self._matmul_params[i], leaves, strict=True)}

        def run(x_, cos_, sin_):
            return torch.func.functional_call(layer, weights, (x_, cos_, sin_))

        if selective:
            out = checkpoint(run, x, cos, sin, use_reentrant=False,
                             context_fn=partial(create_selective_checkpoint_contexts, _sac_policy))
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
        return self.dp is not None and not self.strategy.keeps_all_grads

    def _done(self, group: FlatGroup, buf: torch.Tensor, on_done) -> None:
        self._probe(group.name)
        if self._overlapping:
            # start averaging this group's gradient over the ranks, then finish the previous group
            handle = self.dp.all_reduce_sum_async(buf)
            previous, self._inflight = self._inflight, (group, buf, handle, on_done)
            if previous is not None:
                self._finish(previous)
            return
        on_done(group, buf)
        if not self.strategy.keeps_all_grads:
            group.release_grads()  # the workspace now belongs to the next group

    def _finish(self, item: tuple) -> None:
        group, buf, handle, on_done = item
        handle.wait()
        buf.div_(self.dp.world_size)
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
        if not self.strategy.keeps_all_grads:
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
        model, n_layers, kept = self.model, len(self.block_groups), accumulate
        if self.tied:
            self._grad_buffer(self.embed)  # the head's weight gradient adds into the embedding's
        frozen_head = self.head is None  # LoRA: only the hidden states' gradient is needed
        head_buf = None if frozen_head else self._grad_buffer(self.head)
        weight = model.head_weight
        # Where the head weight's gradient is formed: straight into its (zeroed) buffer, or, when that
        # already holds earlier micro-batches, in the scratch and then added.
        head_grad = None if frozen_head else self._scratch(weight.shape) if kept else weight.grad
        h_in = inputs[n_layers].detach().requires_grad_()
        with self.autocast():
            h = model.model.norm(h_in)
        loss_sum, grad_h = linear_cross_entropy_fwd_bwd(
            h, weight, targets, chunk_size=self.chunk_size, grad_scale=1.0 / targets.numel(),
            backend=self.backend, grad_weight=head_grad, compute_dtype=self.cdt,
        )
        if check_loss:  # before any update; the stepping walk after a norm pre-pass already knows the loss
            if self.scaler.enabled:
                self._check_loss(loss_sum)
            else:
                self._flags.flag(~torch.isfinite(loss_sum), LOSS, self.calls)
        if gate_loss:  # the one-walk step: the loss test, before the head's update
            self._gate(loss_sum / targets.numel(), None)
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
        cos, sin = self.model.rope(ids.shape[1], ids.device)
        for i in reversed(range(len(self.block_groups))):
            group = self.block_groups[i]
            buf = self._grad_buffer(group)
            # a selective graph can be backpropagated once only: the norm-only walk recomputes it
            if graphs[i] is not None and (free_inputs or self.execution.block_mode(i) == "keep"):
                x, out, leaves = graphs[i]
                x.grad = None
                backward(out, grad_x, retain_graph=not free_inputs)
            else:
                x = inputs[i].detach().requires_grad_()
                with self.autocast(), _replayed_rng(self._block_rng[i] if self._block_rng else None, ids.device):
                    out, leaves = self._run_block(i, x, cos, sin)
                    out = out.to(self.cdt)
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
        lookup_grad.index_add_(0, ids.reshape(-1), grad_x.reshape(-1, grad_x.shape[-1]).float())
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
        found_inf = self._flags.bad  # set by a non-finite loss or gradient in this step or an earlier one
        if self.strategy.clip == "adagc":
            self._adagc_clip(group.name, group.views(grad), 1.0 / self.scaler.scale, found_inf)
        scale = coef if self.scaler.scale == 1.0 else coef * (1.0 / self.scaler.scale)
        if group.name in self.frozen:  # progressive stacking's frozen blocks: no update at all
            return
        self.updater.update_flat(group.flat_params, grad, group.exp_avg, group.exp_avg_sq, lr=self._lr,
                                 step=self.optimizer_steps + 1, decay=group.decay, grad_scale=scale,
                                 found_inf=found_inf, param_copy=group.compute, group=group.name)
        self._flags.stepped()

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        self._lr = lr
        self.calls += 1
        self._skip = False
        self._flags.start_step()
        st, accum = self.strategy, len(micro_batches)
        if accum > 1 and not st.keeps_all_grads:
            raise AprError("gradient accumulation needs the per-group gradient buffers of the buffer plan")
        if st.keeps_all_grads:
            return self._step_kept(micro_batches)
        ids, targets = self.split(micro_batches[0])
        inputs, graphs = self._forward(ids)
        if st.norm_prepass:
            return self._step_prepass(ids, targets, inputs, graphs, self.scaler.scale)
        return self._step_single_walk(ids, targets, inputs, graphs)

    def _step_kept(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """Kept gradients: every group keeps its gradient across the step's micro-batches (one backward
        walk each), then the exact global norm is known and all groups step."""
        for g in self.groups:
            g.own_grad.zero_()
        loss = torch.zeros((), device=self.device)
        accum = len(micro_batches)
        for k, batch in enumerate(micro_batches):
            ids, targets = self.split(batch)
            inputs, graphs = self._forward(ids)
            loss_sum = self._walk(ids, targets, inputs, graphs, self.scaler.scale / accum, lambda g, buf: None,
                                  free_inputs=True, accumulate=k > 0)
            loss += loss_sum / (targets.numel() * accum)
        if self.dp is not None:  # average the accumulated gradients over the ranks, all groups at once
            for handle in [self.dp.all_reduce_sum_async(g.own_grad) for g in self.groups]:
                handle.wait()
            for g in self.groups:
                g.own_grad.div_(self.dp.world_size)
        sq = {g.name: self.backend.sq_norm(g.own_grad) for g in self.groups}
        self._keep_sq(sq, self.scaler.scale)
        norm, overflow = self._known_norm(sq)
        flagged = not overflow and self._gate(loss, norm)
        if not overflow and not flagged:
            coefs = self._coefs(sq, norm)
            for g in self.groups:
                self._apply(g, g.own_grad, coefs[g.name])
            self._stepped()
        for g in self.groups:
            g.release_grads()
        return StepResult(loss, norm, skipped=overflow, flagged=flagged)

    def _step_prepass(self, ids, targets, inputs, graphs, grad_mult: float) -> StepResult:
        """Exact global clipping (or the fp16 overflow check) in O(one block) gradient memory: a
        norm-only walk, then the stepping walk over the same saved block inputs."""
        sq: dict[str, torch.Tensor] = {}

        def record(g: FlatGroup, buf: torch.Tensor) -> None:
            sq[g.name] = self.backend.sq_norm(buf)

        loss_sum = self._walk(ids, targets, inputs, graphs, grad_mult, record, free_inputs=False)
        loss = loss_sum / targets.numel()
        self._keep_sq(sq, self.scaler.scale)
        norm, overflow = self._known_norm(sq)
        if overflow:
            return StepResult(loss, norm, skipped=True)
        if self._gate(loss, norm):
            return StepResult(loss, norm, flagged=True)
        coefs = self._coefs(sq, norm)

        def step(g: FlatGroup, buf: torch.Tensor) -> None:
            self._apply(g, buf, coefs[g.name])

        self._walk(ids, targets, inputs, graphs, grad_mult, step, free_inputs=True, check_loss=False)
        self._stepped()
        return StepResult(loss, norm)

    def _step_single_walk(self, ids, targets, inputs, graphs) -> StepResult:
        """No clipping or per-block clipping: each group steps as soon as its gradient is complete."""
        sq: dict[str, torch.Tensor] = {}
        per_block = self.strategy.clip == "per_block"

        def step(g: FlatGroup, buf: torch.Tensor) -> None:
            s = sq[g.name] = self.backend.sq_norm(buf)
            if self._skip:  # the loss test flagged the step before the first update
                return
            coef = self._clip_coef(s.sqrt()) if per_block else 1.0
            # a non-finite gradient reaches no weights; the groups updated before it make the state partial
            self._flags.flag(~torch.isfinite(s), GRADIENTS, self.calls)
            self._apply(g, buf, coef)

        loss_sum = self._walk(ids, targets, inputs, graphs, 1.0, step, free_inputs=True,
                              gate_loss=self.step_gate is not None)
        self._keep_sq(sq)
        norm = torch.stack([sq[g.name] for g in self.groups]).sum().sqrt()
        if self._skip:
            return StepResult(loss_sum / targets.numel(), norm, flagged=True)
        self._stepped()
        return StepResult(loss_sum / targets.numel(), norm)

    def _stepped(self) -> None:
        self.optimizer_steps += 1
        self.scaler.update(found_inf=False)

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
        self._check_state_names(tensors)
        for name, dst in self.train_state_tensors().items():
            dst.copy_(tensors[name])
        self._refresh_compute()


class StandardEngine(Engine):
    """Plain autograd over the model, then ``apr/train/finish.py`` (clip, the updater's torch AdamW).
    The gradient source of one process and DDP; ``sharded.py`` runs the same steps on FSDP2 shards."""

    source = "standard"
    declares = staticmethod(planned_buffers.autograd_buffers)  # torch allocates these at the declared sizes

    def __init__(self, plan: Resolved, model: LlamaForCausalLM, device: torch.device, backend: KernelBackend,
                 loss: CausalLM | None = None):
        super().__init__(plan, model, device, backend, loss)
        config = plan.config
        named = dict(model.named_parameters())
        self.groups = [(name, [named[s.name] for s in specs]) for name, specs in group_specs(config)]
        self.named = {s.name: named[s.name] for _, specs in group_specs(config) for s in specs}
        extra = self.loss_parameters()  # the loss's own parameters: their group, no weight decay
        if extra:
            self.groups.append((LOSS_GROUP, list(extra.values())))
            self.named.update(extra)
            if self.adagc_ema:
                self.adagc_ema[LOSS_GROUP] = torch.zeros(len(extra), device=device)
        decay_names = {s.name for _, specs in group_specs(config) for s in specs if s.decay}
        self.updater.bind(self.named, decay_names, device, groups=self.groups)
        self.idle_groups: set[str] = set()  # groups the last step gave no gradient (apr/train/blocknorms.py)
        self.trunk = bool(spec.trunk_specs(config))  # a transformed stacking trunk, outside the groups

    def freeze(self, groups: set[str]) -> None:
        """Frozen groups leave the updater: no update of their weights or moments."""
        super().freeze(groups)
        self.updater.freeze([p for name, ps in self.groups if name in self.frozen for p in ps])

    # ------------------------------------------------------------------------------ the step

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        self._skip = False
        self.loss.begin_step(self.current_step)
        for p in self.named.values():
            p.grad = None
        loss = self._backward(micro_batches)
        for name, _ in self.groups:
            self._probe(name)
        local = self._reduced_grads()
        self.idle_groups = {name for name, _ in self.groups} - set(local)
        return finish_step(self, loss, local, self._group_sq(local), lr)

    def _micro_loss(self, ids: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        return self.loss(self, self.model, ids, targets)

    def _backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """Every micro-batch's loss part, backpropagated (scaled by the fp16 loss scale and divided
        by the micro-batches); returns the step's mean loss."""
        accum, scale = len(micro_batches), self.scaler.scale
        loss_total = torch.zeros((), device=self.device)
        for k, batch in enumerate(micro_batches):
            ids, targets = self.split(batch)
            loss = self._micro_loss(ids, targets, last=k == accum - 1)
            self._check_loss(loss)
            (loss * (scale / accum) if scale != 1.0 or accum != 1 else loss).backward()
            loss_total += loss.detach() / accum
        return loss_total

    def _reduced_grads(self) -> dict[str, list[torch.Tensor]]:
        """Each live group's gradients (a group with every parameter's gradient; distillation's
        phase 1 trains one block), averaged over the data-parallel ranks and unscaled."""
        local = {name: [p.grad for p in group] for name, group in self.groups
                 if all(p.grad is not None for p in group)}
        grads = [g for gs in local.values() for g in gs]
        if self.dp is not None and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dp.average_(flat)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(parts, grads, strict=True)])
        if self.scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        return local

    def _group_sq(self, local: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every group's squared norm over its concatenated gradients (the reduction of the walk's flat
        buffers, so the two sources agree bitwise); zero for a group without gradients."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return {name: self.backend.sq_norm(torch.cat([g.reshape(-1) for g in local[name]])) if name in local
                else zero for name, _ in self.groups}

    # ------------------------------------------------------------------------------ state

    def buffer_bytes(self) -> dict[str, int]:
        """The standard engine's parameters, gradients and AdamW moments (after a step), by component."""
        out = {"weights": 0, "gradients": 0, "adamw_m": 0, "adamw_v": 0}
        for p in self.named.values():
            out["weights"] += p.untyped_storage().nbytes()
            if p.grad is not None:
                out["gradients"] += p.grad.untyped_storage().nbytes()
            for t, component in zip(self.updater.moments(p) or (), ("adamw_m", "adamw_v"), strict=False):
                out[component] += t.untyped_storage().nbytes()
        return out

    def train_state_tensors(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named.items():
            m, v = self.updater.moments(p) or (torch.zeros_like(p), torch.zeros_like(p))
            out[name] = p.detach()
            out[names.OPT_M + name] = m
            out[names.OPT_V + name] = v
        if self.trunk:  # a stacking trunk's frozen tensors (docs/design.md, "StackWise progressive stacks")
            out.update(trunk_state(self.model, self.config))
        return out

    @torch.no_grad()
    def load_train_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self._check_state_names(tensors)
        for name, p in self.named.items():
            p.copy_(tensors[name])
            self.updater.set_moments(p, tensors[names.OPT_M + name].to(p.device, torch.float32).clone(),
                                     tensors[names.OPT_V + name].to(p.device, torch.float32).clone(),
                                     self.optimizer_steps)
        if self.trunk:
            load_trunk_state(self.model, self.config, tensors)

    def meta_state(self) -> dict:
        meta = super().meta_state()
        if self.loss.per_param_steps:  # each parameter's own AdamW step count (distillation's phase 1)
            steps = {name: self.updater.steps_of(p) for name, p in self.named.items()}
            meta["param_steps"] = {name: n for name, n in steps.items() if n is not None}
        return meta

    def load_meta_state(self, meta: dict) -> None:
        super().load_meta_state(meta)
        saved = meta.get("param_steps") or {} if self.loss.per_param_steps else {}
        for name, p in self.named.items():
            self.updater.set_steps(p, saved.get(name, 0) if self.loss.per_param_steps else self.optimizer_steps)


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


# ------------------------------------------------------------------------- selective recompute

# Ops whose outputs a selectively recomputed block keeps: the matmuls and attention (the expensive
# ops); everything else (norms, rope, silu, products, residual adds) is recomputed in the backward.
_SAVED_OPS = None


def _saved_ops() -> set:
    global _SAVED_OPS
    if _SAVED_OPS is None:
        aten = torch.ops.aten
        names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_cudnn_attention"]
        _SAVED_OPS = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    return _SAVED_OPS


def _sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective(layer, x, cos, sin):
    return checkpoint(layer, x, cos, sin, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _sac_policy))
