"""The loss parts of the composed engine (docs/design.md, "The composed engine").

A loss part maps a micro-batch to the scalar the gradient source differentiates, on either
autograd source (one process, DDP or FSDP2 shards: under FSDP2 it runs inside the root module's
forward, so the embedding and head are gathered while it reads them). ``CausalLM`` is the
pretraining loss through the model's one loss entry point (``LlamaForCausalLM.loss``); the
distillation losses live in ``apr/train/distill.py``; ``MaskedLM`` is the masked-LM objective;
``CustomTargets`` trains on targets from the data. The flat-buffer walk fuses the causal-LM loss
into its head step (``linear_cross_entropy_fwd_bwd``) and takes only ``CausalLM``.

The protocol: ``begin_step(step)`` before the step's micro-batches, ``__call__(engine, lm, ids,
targets)`` per micro-batch, ``lr_factor(loss)`` once the step's update is decided (a loss may
scale its step's LR, as distillation's autotune does), ``state_dict``/``load_state_dict`` for the
checkpoint's engine metadata. A loss with its own validation loss (``MaskedLM``, ``CustomTargets``) has
``eval_loss_sum(engine, batch)``; the others are scored by ``Engine.eval_loss_sum``.
"""

from __future__ import annotations

import contextlib
import zlib

import torch

from apr.errors import AprError
from apr.model.time import conditioned, row_steps, set_fixed_step

IGNORE = -100  # a target position that adds no loss (the kernels' ignore_index)


class RoutingBalance:
    """``model.architecture.moe``'s load-balancing term (apr/model/moe.py ``balance_loss``, the mean
    over the blocks) times ``balance_loss_coef``, added to each micro-batch's loss, and the step's
    routing figures for the step log: the balance loss (mean over the step's micro-batches) and the
    share of routed rows each expert took, per block (kept on the device until a log step reads them)."""

    def __init__(self, coef: float):
        self.coef = coef
        self.begin_step()

    def begin_step(self) -> None:
        self._balance: torch.Tensor | None = None
        self._load: torch.Tensor | None = None
        self._micro = 0

    def term(self, lm) -> torch.Tensor:
        """The term of the forward just run (its blocks' ``mlp.balance`` and ``mlp.load``)."""
        blocks = [layer.mlp for layer in lm.model.layers]
        balance = torch.stack([b.balance for b in blocks]).mean()
        load = torch.stack([b.load for b in blocks])
        self._balance = balance.detach() if self._balance is None else self._balance + balance.detach()
        self._load = load if self._load is None else self._load + load
        self._micro += 1
        return balance * self.coef

    def metrics(self, dp=None) -> dict:
        """The step's figures (a host read; averaged over the data-parallel ranks): ``moe_balance_loss``,
        ``moe_expert_load`` (each expert's share of the routed rows, mean over the blocks) and
        ``moe_max_expert_load`` (the largest share any expert took in any block); empty before a step."""
        if self._load is None:
            return {}
        share = self._load.double() / self._load.sum(dim=1, keepdim=True).double()
        figures = torch.cat([(self._balance / self._micro).double().reshape(1), share.reshape(-1)])
        if dp is not None:
            figures = dp.average_(figures)
        balance, share = figures[0], figures[1:].view_as(share)
        return {"moe_balance_loss": float(balance), "moe_expert_load": share.mean(dim=0).tolist(),
                "moe_max_expert_load": float(share.max())}


class TimeDraw:
    """``model.architecture.time``'s steps of a training micro-batch (apr/model/time.py): each row's own
    (interpretation input, ``row_steps``) or the stage's (depth: the model's ``fixed_step``); with
    ``masking``, each row's masking rate ``(step + 1) / num_time_steps``."""

    def __init__(self, time, seed: int):
        self.time, self.seed = time, seed

    def steps(self, lm, ids: torch.Tensor, step: int) -> torch.Tensor:
        if str(self.time.interpretation) == "depth":
            return torch.full((ids.shape[0],), lm.model.time_embedding.fixed_step, dtype=torch.int64)
        return row_steps(ids, self.time.num_time_steps, self.seed, step)

    def rates(self, steps: torch.Tensor) -> torch.Tensor:
        return (steps.double() + 1) / self.time.num_time_steps


class CausalLM:
    """Mean next-token cross-entropy over the micro-batch (plus the mixture of experts' balance term
    with ``routing``; each row at its time step with ``time``)."""

    kind: str | None = None  # None: the engine keeps its own kind in checkpoints
    per_param_steps = False  # every parameter takes every update

    def __init__(self, routing: RoutingBalance | None = None, time: TimeDraw | None = None):
        self.routing, self.time = routing, time
        self.step = 1

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.routing is not None:
            self.routing.begin_step()

    def __call__(self, engine, lm, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        steps = None if self.time is None else self.time.steps(lm, ids, self.step)
        with engine.autocast(), _conditioned(lm, steps):
            hidden = engine.hidden_states(lm, ids)
        loss = lm.loss(hidden, targets, chunk_size=engine.chunk_size, backend=engine.backend,
                       compute_dtype=engine.cdt, norm_context=engine.autocast())
        return loss if self.routing is None else loss + self.routing.term(lm)

    def lr_factor(self, loss: torch.Tensor) -> float:
        return 1.0

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass


class CustomTargets(CausalLM):
    """StackWise's custom objective (``training.mode: custom``): the targets come from the data. Each
    batch row is the row's ``seq_len + 1`` ids then as many targets (apr/data/loader.py,
    ``targets_column``); the model reads the first ``seq_len`` ids and position ``i`` is trained to
    predict target ``i + 1`` (so targets equal to the ids give the causal LM); a target of ``IGNORE``
    adds no loss. The loss is the mean cross-entropy over the targets that are not ``IGNORE`` (0 where
    a micro-batch has none); validation (``eval_loss_sum``) sums it over the same positions. A batch of
    ids alone (the random rows of ``apr train plan --trace`` and ``apr profile``) is scored as the
    causal LM, the same shapes and cost."""

    def __init__(self, seq_len: int, routing: RoutingBalance | None = None, time: TimeDraw | None = None):
        super().__init__(routing, time)
        self.seq_len = seq_len

    def unpack(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's input and its targets from ``Engine.split``'s halves of a packed batch."""
        if ids.shape[1] != 2 * self.seq_len + 1:  # ids alone: their next tokens
            return ids, targets
        return ids[:, :self.seq_len], targets[:, self.seq_len + 1:]

    def _sum(self, engine, lm, ids, targets, total: bool, steps=None) -> torch.Tensor:
        with engine.autocast(), _conditioned(lm, steps):
            hidden = engine.hidden_states(lm, ids)
        return lm.loss(hidden, targets, chunk_size=engine.chunk_size, backend=engine.backend,
                       compute_dtype=engine.cdt, norm_context=engine.autocast(), total=total)

    def __call__(self, engine, lm, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ids, targets = self.unpack(ids, targets)
        steps = None if self.time is None else self.time.steps(lm, ids, self.step)
        counted = (targets != IGNORE).sum().clamp_min(1)  # on the device: no host read per micro-batch
        loss = self._sum(engine, lm, ids, targets, False, steps) * (targets.numel() / counted)
        return loss if self.routing is None else loss + self.routing.term(lm)

    @torch.no_grad()
    def eval_loss_sum(self, engine, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy over a validation batch's targets that are not ``IGNORE``, and their number."""
        ids, targets = self.unpack(*engine.split(batch))
        loss = engine.in_root(lambda e, lm, i, t: self._sum(e, lm, i, t, True), ids, targets)
        return loss, int((targets != IGNORE).sum())


def _conditioned(lm, steps: torch.Tensor | None):
    """``conditioned`` where the micro-batch has time steps, else nothing."""
    return contextlib.nullcontext() if steps is None else conditioned(lm, steps)


def mask_positions(rows: torch.Tensor, rate, seed: int, step: int) -> torch.Tensor:
    """The masked positions of ``rows`` (token ids ``[batch, seq]``) as a bool tensor on the CPU:
    each position is masked with probability ``rate`` (a float, or one per row), drawn from a
    generator seeded by the run's seed, the step (0 at evaluation) and the row's own tokens, so a
    row's mask depends on neither its
    micro-batch nor its rank nor the process that resumes it (bitwise resume; data parallelism
    equals one process with the larger batch)."""
    if type(rows) is not torch.Tensor:  # fake tensors (apr train plan --trace): no tokens to read, a mask's shape
        return torch.zeros(rows.shape, dtype=torch.bool)
    cpu = rows.detach().to("cpu", torch.int64).contiguous()
    out = torch.empty(cpu.shape, dtype=torch.bool)
    for i, row in enumerate(cpu):
        digest = zlib.crc32(row.numpy().tobytes())
        gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4_294_967_311 + digest) % 2**63)
        out[i] = torch.rand(row.shape[0], generator=gen) < (rate if isinstance(rate, float) else float(rate[i]))
    return out


def masked_batch(ids: torch.Tensor, mask: torch.Tensor, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's input (each masked position replaced by ``mask_token_id``) and the targets (the
    original token where masked, ``IGNORE`` elsewhere: those positions add no loss)."""
    mask = mask.to(ids.device)
    return torch.where(mask, mask_token_id, ids), torch.where(mask, ids, IGNORE)


def bidirectional(model) -> None:
    """Every block's attention attends to the whole sequence (both ways), as a masked LM's does."""
    for layer in model.model.layers:
        layer.self_attn.causal = False


class MaskedLM:
    """The masked-LM objective (``training.mode: mlm``, BERT-style): a ``training.mlm.mask_rate``
    share of each micro-batch's input positions is replaced by ``mask_token_id`` and the model, its
    attention made bidirectional, predicts the original tokens there; the loss is the mean
    cross-entropy over the masked positions only (0 where a micro-batch has none). The input is the
    micro-batch's ``seq_len`` positions (``ids``; the next-token ``targets`` are not read).
    Evaluation (``eval_loss_sum``) masks the validation rows the same way at step 0, so every
    evaluation of a run scores the same positions. With ``time`` each row runs at its time step, and
    under time-step masking (``time.masking``) is masked at its step's rate, evaluation at the
    model's fixed step's."""

    kind: str | None = None
    per_param_steps = False

    def __init__(self, rate: float, mask_token_id: int, seed: int, routing: RoutingBalance | None = None,
                 time: TimeDraw | None = None):
        self.rate, self.mask_token_id, self.seed = rate, mask_token_id, seed
        self.step = 1
        self.routing = routing  # moe: the balance term, as CausalLM's
        self.time = time

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.routing is not None:
            self.routing.begin_step()

    def _rate(self, lm, steps: torch.Tensor | None, rows: int):
        if self.time is None or not self.time.time.masking:
            return self.rate
        if steps is None:  # evaluation: the model's fixed step
            steps = torch.full((rows,), lm.model.time_embedding.fixed_step, dtype=torch.int64)
        return self.time.rates(steps)

    def _sum(self, engine, lm, ids: torch.Tensor, step: int, total: bool,
             steps: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        mask = mask_positions(ids, self._rate(lm, steps, ids.shape[0]), self.seed, step)
        inputs, targets = masked_batch(ids, mask, self.mask_token_id)
        with engine.autocast(), _conditioned(lm, steps):
            hidden = engine.hidden_states(lm, inputs)
        loss = lm.loss(hidden, targets, chunk_size=engine.chunk_size, backend=engine.backend,
                       compute_dtype=engine.cdt, norm_context=engine.autocast(), total=total)
        return loss, int(mask.sum())

    def __call__(self, engine, lm, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        steps = None if self.time is None else self.time.steps(lm, ids, self.step)
        mean_over_all, masked = self._sum(engine, lm, ids, self.step, total=False, steps=steps)
        loss = mean_over_all * (ids.numel() / max(masked, 1))  # the mean over the masked positions
        return loss if self.routing is None else loss + self.routing.term(lm)

    @torch.no_grad()
    def eval_loss_sum(self, engine, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy over the masked positions of a validation batch, and their number."""
        ids, _ = engine.split(batch)
        return engine.in_root(lambda e, lm, i, _t: self._sum(e, lm, i, 0, total=True), ids, ids)

    def lr_factor(self, loss: torch.Tensor) -> float:
        return 1.0

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass


def objective_loss(config, model, source: str) -> CausalLM | CustomTargets | MaskedLM | None:
    """The loss part of ``training.mode`` other than distillation (apr/train/distill.py): for
    causal_lm, None (the engine's own ``CausalLM``) or with ``model.architecture.moe`` a ``CausalLM``
    with its balance term, with ``model.architecture.time`` one drawing each row's time step; for
    custom, ``CustomTargets`` (with either); for mlm,
    ``MaskedLM`` over ``model`` made bidirectional. ``source``: the resolved plan's gradient source."""
    tr, moe = config.training, config.model.architecture.moe
    time = None
    if config.model.architecture.time is not None:
        if source != "standard":  # validate and the plan refuse it at training.engine
            raise AprError("model.architecture.time runs on autograd (training.engine: standard): the flat-buffer "
                           "walk embeds tokens and backpropagates the embedding itself, without the time embedding")
        set_fixed_step(model, config)  # depth: this stage's step
        time = TimeDraw(config.model.architecture.time, tr.seed)
    routing = None
    if moe is not None:
        if source != "standard":  # validate and the plan refuse it at training.engine
            raise AprError("model.architecture.moe runs on autograd (training.engine: standard): the flat-buffer "
                           "walk backpropagates block by block and would drop the load-balancing loss's gradient")
        routing = RoutingBalance(moe.balance_loss_coef)
    if str(tr.mode) == "custom":
        return CustomTargets(config.data.seq_len, routing, time)
    if str(tr.mode) != "mlm":
        return None if routing is None and time is None else CausalLM(routing, time)
    bidirectional(model)
    return MaskedLM(tr.mlm.mask_rate, tr.mlm.mask_token_id, tr.seed, routing, time)
