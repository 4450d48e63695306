"""Sharded data parallelism on torch FSDP2 (``training.sharding``): the engine's sharded layout,
under either gradient source (autograd, apr/train/autograd.py; the walk's hooks, apr/train/sharded_walk.py).

``fully_shard`` is applied to every decoder block and to a root module holding the rest (the
embedding, the final norm and the head), so a block's weights are all-gathered for its forward
and backward and its gradient is reduce-scattered (averaged over the ranks) as soon as its
backward is done. ``shard_grad_op`` keeps the gathered weights from the forward to the backward
(ZeRO-2: gradients and AdamW moments sharded); ``full`` frees them after the forward and gathers
again in the backward (ZeRO-3: weights sharded too); ``hybrid`` is ``full`` within a node and
replicas across nodes (a 2-D mesh: gradients reduce-scattered within the node, all-reduced across
nodes). torch's AdamW runs on each rank's shards.

The loss is computed inside the root module's forward (``_LossModule``), so the embedding and
the tied head are gathered while they are used. The global gradient norm is the all-reduced sum
of each rank's squared shard norms; clipping scales the local shards. Checkpoints are written in
parts, each rank its own rows (``local_state_tensors``; apr/checkpoint/parts.py), and read back as
whole tensors that ``load_train_state_tensors`` re-shards, so a run resumes on any number of
ranks. See docs/design.md, "Sharding and elastic resume".

Under ``training.reduction: canonical`` no micro-batch is reduce-scattered: FSDP2 leaves each one's
whole gradient on the rank that computed it; ``keep_micro`` moves it into a bucket per shard
(apr/train/reduction.py, ``ShardedCanonicalSum``), ``canonical_grads`` sums this rank's shard of every
global micro-batch in the fixed tree and sets it as the parameters' sharded gradients. The norms
(clipping, AdaGC, the logged norm) are taken over the whole mean gradient, all-gathered once a step,
exactly as one process takes them: the same bits on any number of ranks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from apr.checkpoint import names
from apr.checkpoint.files import ST_DTYPE_NAMES
from apr.checkpoint.parts import LazyTensors
from apr.errors import AprError
from apr.launch import env_ranks_per_node
from apr.model.llama import LlamaForCausalLM
from apr.train.autograd import Params
from apr.train.engine import group_specs
from apr.train.reduction import ShardedCanonicalSum


class _LossModule(nn.Module):
    """The model with its loss in one forward: FSDP2 gathers a module's parameters for its forward."""

    def __init__(self, lm: LlamaForCausalLM, engine):
        super().__init__()
        self.lm = lm
        self._engine = [engine]  # not a submodule

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, total: bool = False, summed=None):
        """The engine's loss part (training), the summed causal-LM loss (``total``: evaluation), or a loss
        part's own evaluation sum (``summed(engine, lm, ids, targets)``: the masked LM's, custom targets')."""
        e = self._engine[0]
        if summed is not None:
            return summed(e, self.lm, ids, targets)
        if not total:
            return e.loss(e, self.lm, ids, targets)
        with e.autocast():
            hidden = e.hidden_states(self.lm, ids)
        return self.lm.loss(hidden, targets, chunk_size=e.chunk_size, backend=e.backend, compute_dtype=e.cdt,
                            norm_context=e.autocast(), total=True)


def _shard(model: LlamaForCausalLM, engine, strategy: str, device: torch.device) -> tuple[_LossModule, object]:
    """``fully_shard`` every block and the root; returns the root and the shard process group."""
    world = dist.get_world_size()
    if strategy == "hybrid":  # shard within a node, replicate across nodes (HSDP)
        group = shard_group_size(world)
        mesh = init_device_mesh(device.type, (world // group, group), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    reshard = strategy in ("full", "hybrid")
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    for layer, following in zip(layers[:-1], layers[1:], strict=True):  # gather the next block while this one computes
        layer.set_modules_to_forward_prefetch([following])
    root = _LossModule(model, engine)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard)
    return root, mesh.get_group("shard")


def shard_group_size(world: int) -> int:
    """Ranks one shard group spans under hybrid sharding: the ranks of a node (torchrun's
    LOCAL_WORLD_SIZE; ``APR_SHARD_GROUP_SIZE`` overrides it, e.g. to test on one machine)."""
    group = env_ranks_per_node(world)
    if group is None or group < 1 or world % group:
        raise AprError(f"hybrid sharding: {world} ranks do not split into nodes of {group}: every node needs the "
                       "same number of ranks")
    return group


class Shards:
    """The FSDP2 layout (see the module docstring): each rank holds its rows of every tensor."""

    def __init__(self, engine):
        self.e = engine
        model = engine.model.to(engine.device)
        self.root, self.shard_group = _shard(model, engine, engine.plan.sharding, engine.device)
        self.params = Params(engine)
        # training.reduction: canonical: every micro-batch's gradient kept whole, summed shard by shard in
        # the fixed tree over the global micro-batch index (see the module docstring)
        self.canonical = (ShardedCanonicalSum(engine.dp, self.shard_group.size())
                          if engine.plan.reduction == "canonical" else None)
        self._whole_sq: dict[str, torch.Tensor] = {}  # canonical: each live group's squared norm, whole
        self._whole_norms: dict[str, torch.Tensor] = {}  # canonical, AdaGC: a group's per-tensor norms, whole
        # canonical: id(p) -> (its offset in a bucket's row, FSDP2's chunk of rows, a row's width)
        self._place: dict[int, tuple[int, int, int]] = {}
        self.live_names: list[str] = []

    # ------------------------------------------------------------------------------ steps

    def all_sq(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Squared norms over the whole tensors from their local shards' (one all-reduce over the shard
        group; hybrid replicas hold equal shards)."""
        sq = torch.stack(parts)
        dist.all_reduce(sq, group=self.shard_group)
        return sq

    @staticmethod
    def local_sq(grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=grads[0].device))

    def tensor_norms(self, grads: list[torch.Tensor], name: str | None = None) -> torch.Tensor:
        """Each tensor's norm all-reduced from its shards' (AdaGC on shards); canonical: the norms of
        group ``name``'s whole tensors, which ``canonical_grads`` took."""
        if name in self._whole_norms:
            return self._whole_norms[name]
        return self.all_sq([g.float().pow(2).sum() for g in grads]).sqrt()

    @contextmanager
    def whole_weights(self):
        """Every FSDP2 unit's weights gathered on every rank (in-training evaluation and samples read
        the model outside the units' forwards: KV-cache decoding walks the layers' parts); resharded
        after. Costs the whole model's weights, not its optimizer state, for the duration."""
        units = [*self.e.model.model.layers, self.root]
        reshard = str(self.e.config.training.sharding) in ("full", "hybrid")
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)  # a forward inside keeps them gathered
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(reshard, recurse=False)

    def micro_loss(self, ids: torch.Tensor, targets: torch.Tensor, last: bool) -> torch.Tensor:
        # reduce-scatter once, after the last micro-batch; canonical: never (its own sum, keep_micro)
        self.root.set_requires_gradient_sync(last and self.canonical is None)
        return self.root(ids, targets)

    # ------------------------------------------------------------------------------ canonical reduction

    def _unsharded_grads(self) -> dict[int, torch.Tensor | None]:
        """Each parameter's (by id) whole gradient of the micro-batch just backpropagated, which FSDP2
        keeps on its unsharded parameter when it does not reduce-scatter; taken away, so the next
        micro-batch starts from none. FSDP2's per-parameter records are torch internals: read here only."""
        out: dict[int, torch.Tensor | None] = {}
        for unit in [*self.e.model.model.layers, self.root]:
            state = unit._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # older torch: one group or none
            groups = groups if groups is not None else [g for g in (state._fsdp_param_group,) if g is not None]
            for record in (r for g in groups for r in g.fsdp_params):
                grad = record.unsharded_accumulated_grad  # set only under a reduce dtype of its own
                unsharded = getattr(record, "_unsharded_param", None)
                if grad is None and unsharded is not None:
                    grad = unsharded.grad
                record.unsharded_accumulated_grad = None
                if unsharded is not None:
                    unsharded.grad = None
                out[id(record.sharded_param)] = grad.to_local() if isinstance(grad, DTensor) else grad
        return out

    def keep_micro(self, loss: torch.Tensor) -> None:
        """Canonical: this micro-batch's whole gradient into a bucket of its own, one padded row per
        shard (``reduction.ShardedCanonicalSum``), for the groups whose every parameter has one."""
        grads = self._unsharded_grads()
        live = [(name, group) for name, group in self.params.groups if all(grads.get(id(p)) is not None for p in group)]
        self.live_names = [name for name, _ in live]  # the same groups every micro-batch and on every rank
        shards = self.shard_group.size()
        self._place, width = {}, 0
        for _, group in live:
            for p in group:
                chunk, cols = -(-p.shape[0] // shards), p.numel() // p.shape[0]
                self._place[id(p)] = (width, chunk, cols)
                width += chunk * cols
        bucket = torch.zeros((shards, width), dtype=torch.float32, device=self.e.device)
        for _, group in live:
            for p in group:
                offset, chunk, cols = self._place[id(p)]
                whole = grads[id(p)].reshape(p.shape[0], cols)
                full = p.shape[0] // chunk  # shards holding a whole chunk; the next holds the rest
                dst = bucket[:, offset:offset + chunk * cols].view(shards, chunk, cols)
                dst[:full].copy_(whole[:full * chunk].view(full, chunk, cols))
                if full < shards:
                    dst[full, :p.shape[0] - full * chunk].copy_(whole[full * chunk:])
        self.canonical.take(bucket, loss)

    def canonical_grads(self, unscale: bool = True) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
        """Canonical: this rank's shards of the groups' mean gradients over the global batch (set as the
        parameters' sharded ``.grad``; unscaled, or still loss-scaled for the walk's hooks) and the mean
        loss, both summed in the fixed tree; the groups' norms taken over the whole mean gradient
        (``_whole_norms_of``)."""
        e = self.e
        bucket, loss = self.canonical.reduce()  # this rank's shard's row
        if unscale and e.scaler.scale != 1.0:
            bucket.mul_(1.0 / e.scaler.scale)
        local: dict[str, list[torch.Tensor]] = {}
        for name, group in self.params.groups:
            if name not in self.live_names:
                continue
            local[name] = []
            for p in group:
                offset, chunk, cols = self._place[id(p)]
                mine = p.to_local()
                grad = bucket[offset:offset + chunk * cols].view(chunk, cols)[:mine.shape[0]].view(mine.shape)
                p.grad = DTensor.from_local(grad.to(mine.dtype), p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                local[name].append(p.grad.to_local())
        self._whole_norms_of(bucket, local)
        return local, loss

    def _whole_norms_of(self, bucket: torch.Tensor, local: dict[str, list[torch.Tensor]]) -> None:
        """Each live group's squared norm (and, for AdaGC, each tensor's norm) over the whole mean
        gradient, all-gathered from the shard group's buckets: the sums one process takes, in its order."""
        shards = self.shard_group.size()
        rows = [torch.empty_like(bucket) for _ in range(shards)]
        dist.all_gather(rows, bucket, group=self.shard_group)  # hybrid: every replica holds the same buckets
        self._whole_sq, self._whole_norms = {}, {}
        adagc = self.e.strategy.clip == "adagc"
        for name, group in self.params.groups:
            if name not in local:
                continue
            whole = []
            for p in group:
                offset, chunk, cols = self._place[id(p)]
                rows_of_p = torch.cat([row[offset:offset + chunk * cols] for row in rows])  # padded, shard order
                whole.append(rows_of_p.view(shards * chunk, cols)[:p.shape[0]].reshape(p.shape).to(p.dtype))
            self._whole_sq[name] = self.e.backend.sq_norm(torch.cat([w.reshape(-1) for w in whole]))
            if adagc:
                self._whole_norms[name] = torch.stack(torch._foreach_norm(whole)).float()

    def reduced_grads(self) -> dict[str, list[torch.Tensor]]:
        """This rank's shards of each live group's reduce-scattered gradients, unscaled."""
        local = {name: [p.grad.to_local() for p in group] for name, group in self.params.groups
                 if all(p.grad is not None for p in group)}
        if self.e.scaler.scale != 1.0:
            torch._foreach_mul_([g for gs in local.values() for g in gs], 1.0 / self.e.scaler.scale)
        return local

    def group_sq(self, local: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every group's squared norm, all-reduced from the shards' in one collective (zero without
        gradients: every rank agrees which groups are live)."""
        zero = torch.zeros((), dtype=torch.float32, device=self.e.device)
        if self.canonical is not None:  # taken whole by canonical_grads
            return {name: self._whole_sq.get(name, zero) for name, _ in self.params.groups}
        sq_all = self.all_sq([self.local_sq(local[name]) if name in local else zero for name, _ in self.params.groups])
        return dict(zip([name for name, _ in self.params.groups], sq_all.unbind(), strict=True))

    # ------------------------------------------------------------------------------ state

    def train_state_tensors(self, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors in host memory on rank 0 (``everywhere``: on every rank, as stacking's growth
        needs), gathered one at a time (a collective: every rank calls it; the device holds one
        gathered tensor at a time)."""
        keep = everywhere or dist.get_rank() == 0
        out: dict[str, torch.Tensor] = {}

        def gather(name: str, t: torch.Tensor | None, like: torch.Tensor) -> None:
            full = t.full_tensor() if t is not None else torch.zeros(like.shape, dtype=torch.float32)
            if keep:
                out[name] = full.cpu()

        for name, p in self.params.named.items():
            m, v = self.e.updater.moments(p) or (None, None)
            gather(name, p.detach(), p)
            gather(names.OPT_M + name, m, p)
            gather(names.OPT_V + name, v, p)
        return out

    def local_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's rows of every weight and AdamW moment, under the checkpoint names (its part of
        a sharded checkpoint: apr/checkpoint/parts.py); views of the shards, nothing gathered."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.params.named.items():
            local = p.detach().to_local()
            moments = self.e.updater.moments(p)
            out[name] = local
            for k, prefix in enumerate((names.OPT_M, names.OPT_V)):
                out[prefix + name] = moments[k].to_local() if moments else torch.zeros_like(local)
        return out

    @torch.no_grad()
    def load_local_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back this rank's rows as ``local_state_tensors`` gave them (the orchestrator's branch
        snapshots, taken and restored by every rank at the same step: nothing gathered)."""
        for name, p in self.params.named.items():
            p.to_local().copy_(tensors[name])
            moments = self.e.updater.moments(p)
            if moments is None:
                moments = (torch.zeros_like(p), torch.zeros_like(p))
                self.e.updater.set_moments(p, *moments, self.e.optimizer_steps)
            for k, prefix in enumerate((names.OPT_M, names.OPT_V)):
                moments[k].to_local().copy_(tensors[prefix + name])

    @torch.no_grad()
    def load_train_state_tensors(self, tensors) -> None:
        """Re-shard a checkpoint's tensors: from a ``parts.LazyTensors`` each rank reads only its own
        rows of every tensor (nothing whole in memory); from a dict of whole tensors, each is split."""
        if isinstance(tensors, LazyTensors):
            want = names.state_shapes((s.name, s.shape) for _, specs in group_specs(self.e.config) for s in specs)
            problems = names.tensor_mismatches(tensors.shapes, {n: ST_DTYPE_NAMES.get(d, d)
                                                                for n, d in tensors.dtypes.items()}, want)
            if problems:
                raise AprError("checkpoint tensors do not match the model: " + "; ".join(problems[:5]))
            for name, p in self.params.named.items():
                local = p.to_local()
                start = self.row_start(p)

                def mine(key: str, local=local, start=start) -> torch.Tensor:
                    return tensors.rows(key, start, start + local.shape[0]).to(self.e.device, torch.float32)

                local.copy_(mine(name))
                m, v = torch.zeros_like(p), torch.zeros_like(p)
                m.to_local().copy_(mine(names.OPT_M + name))
                v.to_local().copy_(mine(names.OPT_V + name))
                self.e.updater.set_moments(p, m, v, self.e.optimizer_steps)
            return
        self.e._check_state_names(tensors)
        for name, p in self.params.named.items():
            def shard(t: torch.Tensor, p=p):
                return distribute_tensor(t.to(self.e.device, torch.float32), p.device_mesh, p.placements)

            p.to_local().copy_(shard(tensors[name]).to_local())
            self.e.updater.set_moments(p, shard(tensors[names.OPT_M + name]).clone(),
                                     shard(tensors[names.OPT_V + name]).clone(), self.e.optimizer_steps)

    def row_start(self, p) -> int:
        """The first row of ``p`` this rank holds: FSDP2 splits the first dimension into chunks of
        ceil(rows / ranks) in the order of the mesh's shard dimension."""
        rows, ranks = p.shape[0], self.shard_group.size()
        return p.device_mesh.get_local_rank("shard") * -(-rows // ranks)
