"""The one training engine (docs/design.md, "The composed engine").

``Engine`` holds what every step shares: the resolved plan's settings, precision and the fp16 loss
scale, the loss part (apr/train/losses.py, apr/train/distill.py), the updater (apr/train/updaters.py),
the sticky non-finite flags, AdaGC's state and the one dispatch of the clipping modes; and the one
step, ``train_step``, ended by the one step finisher (apr/train/finish.py). A *gradient source* makes
each optimizer group's gradient in the shape the step strategy asks (all kept, a norm-only pre-pass
then a stepping pass, or streamed: each group updated as soon as its gradient is complete), and a
*layout* says where the state lives:

* sources: the flat-buffer block walk (``apr/train/walk.py``: the backward from the LM head to the
  embedding one block at a time), plain autograd (``apr/train/autograd.py``), and on FSDP2 shards the
  walk's per-group updates from FSDP2's gradient hooks (``apr/train/sharded_walk.py``);
* layouts: replicated (one process, or DDP's all-reduce: ``autograd.Replicated``; the walk does its
  own overlapped all-reduce) and FSDP2 shards (``apr/train/sharded.py``).

``apr/train/build.py`` composes them from the resolved plan; nothing here derives a setting from
the config. Sources take micro-batches of token ids ``[batch, seq_len + 1]`` and a learning rate and
return the step's loss and gradient norm as device tensors. The walk reads nothing on the host during
a step (fp32/bf16): a non-finite loss or gradient sets a sticky flag on the device that every later
update honours (``found_inf``), and the caller reads it with ``check_finite()`` when it reads the host
anyway (log, evaluation, checkpoint). Under fp16 the loss-scale decision needs one host read per step,
and autograd, the textbook loop, reads the loss and the norm every step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from apr.checkpoint import names
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.kernels import KernelBackend
from apr.memory.buffers import fsdp2_buffers
from apr.model import spec
from apr.model.llama import LlamaForCausalLM
from apr.steps.resolved import Resolved
from apr.train import finish
from apr.train.dist import DataParallel
from apr.train.losses import CausalLM
from apr.train.nonfinite import NonFiniteFlags
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
    """The one engine: the step's shared settings and decisions, a gradient source that makes the
    gradients and a layout that holds the state (see the module docstring)."""

    def __init__(self, plan: Resolved, model: LlamaForCausalLM, device: torch.device, backend: KernelBackend,
                 loss: CausalLM | None = None, dp: DataParallel | None = None):
        config = plan.config
        tr = config.training
        self.plan = plan  # the resolved plan this engine was built from (apr/steps/resolved.py)
        self.loss = loss or CausalLM()
        self.current_step = 1  # the run's step in progress (set by the run loop; losses may follow it)
        self.config = config
        self.model = model
        self.device = device
        self.backend = backend
        self.dp = dp  # the data-parallel ranks under torchrun, else None
        self.sharded = dp is not None and plan.sharded  # state sharded over the ranks by FSDP2: checkpoints in parts
        self.execution = plan.execution  # the plan's, never re-derived here (apr/train/build.py)
        self.strategy = plan.strategy
        self.cdt = torch_dtype(tr.mixed_precision)
        self.scaler = DynamicLossScaler(enabled=self.strategy.loss_scaling)
        self.chunk_size = tr.loss_chunk_size
        self.grad_clip = tr.grad_clip
        self.updater = make_updater(config.optimizer, backend)  # the update part (apr/train/updaters.py)
        self.updater.rounding_seed = tr.seed  # training.state_dtype bf16: the stochastic rounding's key
        if self.updater.name == "adafactor" and self.sharded:
            raise AprError("optimizer.name adafactor averages over whole rows and columns of each matrix; under "
                           "training.sharding each rank holds some rows only (see apr train validate)")
        self.optimizer_steps = 0  # updates applied (fp16 overflow steps are not counted)
        self.adagc = tr.adagc
        # AdaGC: per tensor, an EMA of its clipped gradient norm (float32, on the device), one vector
        # per group in buffer-plan order; checkpointed in the engine's metadata (``adagc_ema``).
        self.adagc_ema: dict[str, torch.Tensor] = {}
        if self.strategy.clip == "adagc":
            self.adagc_ema = {name: torch.zeros(len(specs), device=device) for name, specs in group_specs(config)}
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
        # The parts build_engine composes over this engine (apr/train/build.py): the layout
        # (``sharded.Shards``, ``autograd.Replicated``; None: the walk's own flat buffers) and the
        # gradient source that makes every step (``walk.Walk``, ``autograd.Autograd``, ``sharded_walk.ShardedWalk``)
        self.layout = None
        self.gradients = None

    @property
    def _state_part(self):
        """Where the trained state lives: the layout's parameters (autograd, the sharded walk), or the
        walk's own flat buffers."""
        return self.gradients if self.layout is None else self.layout.params

    @property
    def source(self) -> str:
        """``interleaved`` (the block walk, flat buffers or FSDP2 hooks) or ``standard`` (autograd)."""
        return self.gradients.name

    @property
    def declares(self) -> Callable:
        """The buffers this engine's source and layout hold (apr/memory/buffers.py): what the plan's
        memory table sums for it."""
        return fsdp2_buffers if self.sharded else self.gradients.declares

    @property
    def kind(self) -> str:
        """``interleaved`` or ``standard`` (the gradient source), or the loss's own (``distill``)."""
        return self.loss.kind or self.source

    def hidden_states(self, lm: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """The embedding and the blocks (the last block's output), as the loss parts read them."""
        if self.trunk_cache is not None:  # model.stacking.cache_activations: the trunk's rows from disk
            return self.trunk_cache.hidden(lm, ids, self.cdt)
        if self.execution.recomputed_blocks and torch.is_grad_enabled():  # autograd, either layout
            return self._hidden_recomputed(lm, ids)
        return lm.hidden_states(ids, self.cdt)

    def _hidden_recomputed(self, lm: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """``lm.hidden_states`` under the execution policy on autograd (plain, FSDP2 with either source,
        a distillation student, a transformed stacking trunk; the flat-buffer walk recomputes in its own
        walk, apr/train/walk.py): a ``recompute`` block keeps only its input and runs
        again in the backward, a ``selective`` one keeps its matmul and attention outputs
        (docs/design.md, "Execution policy"); ``keep`` blocks as they are."""
        cos, sin = lm.rope(ids.shape[1], ids.device)
        x = lm.model.embed_tokens(ids).to(self.cdt)
        for i, layer in enumerate(lm.model.layers):
            mode = self.execution.block_mode(i)
            if mode == "recompute":
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            elif mode == "selective":
                x = selectively(layer, x, cos, sin)
            else:
                x = layer(x, cos, sin)
            x = x.to(self.cdt)
        return x

    def whole_weights(self):
        """A context in which ``self.model`` holds its whole weights (evaluation, samples): as it is,
        or gathered on every rank for its duration under FSDP2 (``sharded.Shards``)."""
        return self.layout.whole_weights() if self.sharded else nullcontext()

    def tensor_norms(self, grads: list[torch.Tensor], name: str | None = None) -> torch.Tensor | None:
        """Each gradient tensor's norm for AdaGC when ``grads`` are group ``name``'s shards (None:
        computed locally)."""
        return self.layout.tensor_norms(grads, name) if self.sharded else None

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
        if self.sharded:  # inside the root FSDP2 unit's forward, which gathers what it reads
            return self.layout.root(ids, targets, total=True), targets.numel()
        with self.autocast():
            hidden = self.hidden_states(self.model, ids)
        loss = self.model.loss(hidden, targets, chunk_size=self.chunk_size, backend=self.backend,
                               compute_dtype=self.cdt, norm_context=self.autocast(), total=True)
        return loss, targets.numel()

    def in_root(self, fn, ids: torch.Tensor, targets: torch.Tensor):
        """``fn(engine, model, ids, targets)`` (a loss part's evaluation sum) where the model's weights are
        there to read: under FSDP2 inside the root unit's forward, which gathers the embedding and head."""
        if self.sharded:
            return self.layout.root(ids, targets, summed=fn)
        return fn(self, self.model, ids, targets)

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

    def _probe(self, name: str) -> None:
        if self.grad_probe is not None:
            self.grad_probe(name)

    def _stepped(self) -> None:
        """A step whose update was applied (not an fp16 overflow, not a flagged step)."""
        self.optimizer_steps += 1
        self.scaler.update(found_inf=False)

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
        meta.update(self._state_part.meta_state())  # distillation's per-parameter step counts
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
        self._state_part.freeze(self.frozen)

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
        self._state_part.load_meta_state(meta)

    # ------------------------------------------------------------------ the step and the state

    def train_step(self, micro_batches: list[torch.Tensor], lr: float) -> StepResult:
        """One optimizer step over the step's micro-batches: the only step of every source and layout
        (apr/train/finish.py). The gradient source makes the gradients in the shape the step strategy
        asks: all kept (autograd; the walk when accumulating or asked), a norm-only pre-pass then the
        stepping pass over the same forward, or one streamed pass updating each group as it completes."""
        finish.begin(self)
        src, st = self.gradients, self.strategy
        if src.holds_all_grads or st.keeps_all_grads:
            try:
                loss, sq = src.accumulate(micro_batches)
                return finish.known(self, loss, sq, partial(src.apply_all, lr=lr, loss=loss),
                                    sq_scale=src.sq_scale, host=src.reads_host)
            finally:
                src.release()
        if len(micro_batches) > 1:
            raise AprError("gradient accumulation needs the per-group gradient buffers of the buffer plan")
        one_pass = src.forward(micro_batches[0])
        if st.norm_prepass:
            loss, sq = src.norms(one_pass)
            return finish.known(self, loss, sq, partial(src.step_pass, one_pass, lr=lr),
                                sq_scale=src.sq_scale, host=False)
        loss, sq = src.stream(one_pass, partial(finish.stream_coef, self), lr=lr)
        return finish.stream_end(self, loss, sq)

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes the source holds, by buffer name (the walk) or component (autograd)."""
        return self._state_part.buffer_bytes()

    def train_state_tensors(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Weights and AdamW moments under checkpoint names (``everywhere``: on every rank, not only
        the one that writes; FSDP2 gathers them): the walk's flat buffers, or the layout's parameters."""
        return (self.layout or self.gradients).train_state_tensors(everywhere)

    def load_train_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        (self.layout or self.gradients).load_train_state_tensors(tensors)

    def local_state_tensors(self) -> dict[str, torch.Tensor]:
        """FSDP2: this rank's rows of every tensor (its part of a sharded checkpoint)."""
        return self.layout.local_state_tensors()

    def load_local_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.layout.load_local_state_tensors(tensors)

    @property
    def shard_group(self):
        """FSDP2: the process group one shard of each tensor spans (None unsharded)."""
        return self.layout.shard_group if self.sharded else None

    def _check_state_names(self, tensors: dict[str, torch.Tensor]) -> None:
        want = names.state_shapes((s.name, s.shape) for _, specs in group_specs(self.config) for s in specs)
        want.update((n, tuple(s)) for n, s in spec.trunk_specs(self.config))  # a stacking trunk: no moments
        want.update(names.state_shapes((n, tuple(p.shape)) for n, p in self.loss_parameters().items()))
        problems = names.torch_mismatches(tensors, want)
        if problems:
            raise AprError("checkpoint tensors do not match the model: " + "; ".join(problems[:5]))


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


def sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selectively(layer, x, cos, sin):
    return checkpoint(layer, x, cos, sin, use_reentrant=False,
                      context_fn=partial(create_selective_checkpoint_contexts, sac_policy))
