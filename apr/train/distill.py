"""Blockwise distillation (``training.mode: distill``): the engine and the per-block autotune.

``DistillLoss`` is a loss part of the composed engine (apr/train/build.py) on an autograd source
(torch's AdamW over the student; one process, DDP or FSDP2 shards):

- phase 1, step in block ``i``'s window (``apr.steps.distill.phase_at``): the teacher runs
  without gradients up to its block ``end_i``; student block ``i`` maps the teacher's hidden
  state at the input of teacher block ``start_i`` to an output compared with the teacher's at
  ``end_i`` (mse, or 1 - cosine per position). Only block ``i``'s parameters get a gradient, so
  AdamW updates only them (torch skips parameters without one);
- phase 2: the whole student, ``kd_weight x T^2 x KL(teacher || student at temperature T) +
  (1 - kd_weight) x cross-entropy``, the teacher's logits computed without gradients.

The student is an ordinary apr model: its checkpoints, export and evaluation are a plain run's.
The teacher stays on the device, frozen, in float32. ``Autotune`` watches each block's phase-1
loss: a spike (above ``spike_factor`` x its EMA) or a plateau (no new best for
``plateau_patience`` steps) is recorded; in active mode it also multiplies that block's LR
factor by ``lr_decay``. See docs/design.md, "Blockwise distillation".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from apr.checkpoint import names
from apr.checkpoint.hf_import import load_source_weights, source_architecture
from apr.config.schema import AprConfig
from apr.model import surgery
from apr.model.llama import LlamaForCausalLM, build_model
from apr.steps import distill as schedule

PROJ_DOWN, PROJ_UP = names.DISTILL_DOWN, names.DISTILL_UP  # a narrower student's projections


def load_teacher(config: AprConfig, device: torch.device) -> LlamaForCausalLM:
    """The teacher model, float32, frozen, in eval mode on ``device``."""
    path = config.training.distill.teacher
    arch = source_architecture(path)
    teacher = build_model(arch, 0, device="cpu")
    params = dict(teacher.named_parameters())
    with torch.no_grad():
        for name, t in load_source_weights(path, arch).items():
            params[name].copy_(t)
    teacher.requires_grad_(False)
    return teacher.to(device).eval()


@torch.no_grad()
def init_student_from_teacher(student: LlamaForCausalLM, teacher: LlamaForCausalLM,
                              spans: list[tuple[int, int]]) -> None:
    """Student embedding, final norm and head from the teacher; student block ``i`` from teacher
    block ``spans[i][0]`` (``apr.model.surgery.init_block``: key/value heads averaged per group when
    the student has fewer). A narrower student (smaller ``hidden_size``) reads every teacher weight
    through the embedding's top singular directions (``surgery.init_narrower_student``,
    ``surgery.narrowed_layer``; docs/design.md, "Upcycling into a new architecture")."""
    t_arch, s_arch = teacher.arch, student.arch
    if s_arch.hidden_size != t_arch.hidden_size:
        basis = surgery.init_narrower_student(student, teacher)
        t_arch = surgery.narrowed_arch(teacher.arch, s_arch.hidden_size)
        layers = [surgery.narrowed_layer(teacher.model.layers[start], teacher.arch, basis) for start, _ in spans]
    else:
        student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
        student.model.norm.weight.copy_(teacher.model.norm.weight)
        if student.lm_head is not None:
            student.lm_head.weight.copy_(teacher.head_weight)
        layers = [teacher.model.layers[start] for start, _ in spans]
    for i, layer in enumerate(layers):
        surgery.init_block(student.model.layers[i], layer, s_arch, t_arch)


class Autotune:
    """Spikes and plateaus of each block's phase-1 loss, and (active) the block's LR factor."""

    def __init__(self, cfg, blocks: int):
        self.cfg = cfg
        self.ema: list[float | None] = [None] * blocks
        self.best: list[float | None] = [None] * blocks
        self.since: list[int] = [0] * blocks
        self.factor: list[float] = [1.0] * blocks
        self.events: list[tuple[str, str, dict]] = []  # (kind, message, detail), drained by the run

    @property
    def on(self) -> bool:
        return str(self.cfg.mode) != "off"

    def observe(self, block: int, loss: float) -> None:
        if not self.on or not math.isfinite(loss):
            return
        cfg, ema = self.cfg, self.ema[block]
        what = None
        if ema is not None and loss > cfg.spike_factor * ema:
            what = f"spike: loss {loss:.4g} > {cfg.spike_factor:g} x EMA {ema:.4g}"
        best = self.best[block]
        if best is None or loss < best * (1.0 - cfg.min_delta):
            self.best[block], self.since[block] = loss, 0
        else:
            self.since[block] += 1
            if self.since[block] >= cfg.plateau_patience:
                what = what or f"plateau: no new best below {best:.4g} for {self.since[block]} steps"
                self.since[block] = 0
        self.ema[block] = loss if ema is None else cfg.ema_beta * ema + (1.0 - cfg.ema_beta) * loss
        if what is None:
            return
        new = max(self.factor[block] * cfg.lr_decay, cfg.min_lr_factor)
        if str(cfg.mode) == "active":
            action = f"block {block} LR factor {self.factor[block]:g} -> {new:g}"
            self.factor[block] = new
        else:
            action = f"would set block {block} LR factor {self.factor[block]:g} -> {new:g} (monitor mode)"
        self.events.append(("autotune", f"block {block} {what}; {action}",
                            {"block": block, "loss": loss, "factor": self.factor[block], "action": action}))

    def state_dict(self) -> dict:
        # copies: a checkpoint written in the background must hold this step's values, not a later step's
        return {"ema": list(self.ema), "best": list(self.best), "since": list(self.since), "factor": list(self.factor)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.ema, self.best = list(state["ema"]), list(state["best"])
            self.since, self.factor = [int(x) for x in state["since"]], [float(x) for x in state["factor"]]


class Progress:
    """Phase 1's walk over the student's blocks: the block in training, its steps, best loss and steps
    since the best, and why each block ended. With fixed ``phase1_steps`` a block ends after them;
    with convergence stopping (``apr.steps.distill.converging``) also once a step's loss is at or
    below ``convergence_target`` (converged) or after ``convergence_patience`` steps without a new
    best (stalled), and never after more than ``block_steps`` (max_steps). State of the loss part:
    checkpointed, so a resumed run ends its blocks where the uninterrupted one did."""

    def __init__(self, d, blocks: int):
        self.target, self.patience = d.convergence_target, d.convergence_patience
        self.max_steps, self.blocks = schedule.block_steps(d), blocks
        self.block, self.steps, self.best, self.since = 0, 0, None, 0
        self.done = self.max_steps == 0  # phase1_steps 0 skips phase 1

    def observe(self, loss: float) -> str | None:
        """One phase-1 step of the current block with this loss; why the block ends, or None."""
        self.steps += 1
        if self.best is None or loss < self.best:
            self.best, self.since = loss, 0
        else:
            self.since += 1
        if self.target is not None and loss <= self.target:
            return "converged"
        if self.patience is not None and self.since >= self.patience:
            return "stalled"
        return "max_steps" if self.steps >= self.max_steps else None

    def next_block(self) -> None:
        self.block, self.steps, self.best, self.since = self.block + 1, 0, None, 0
        self.done = self.block >= self.blocks

    def state_dict(self) -> dict:
        return {"block": self.block, "steps": self.steps, "best": self.best, "since": self.since, "done": self.done}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.block, self.steps, self.since = int(state["block"]), int(state["steps"]), int(state["since"])
            self.best, self.done = state["best"], bool(state["done"])


class DistillLoss:
    """The distillation loss part (see the module docstring) for either autograd source: one
    process, DDP, or FSDP2 shards of the student (the teacher is whole on every rank)."""

    kind = "distill"
    per_param_steps = True  # phase 1 updates one block at a time: AdamW step counts differ

    def __init__(self, config: AprConfig, teacher: LlamaForCausalLM, student_blocks: int,
                 student_hidden: int | None = None):
        self.config = config
        self.teacher = teacher
        d = config.training.distill
        self.spans = schedule.spans(student_blocks, teacher.arch.num_hidden_layers, d.block_map)
        self.block_loss, self.temperature, self.kd_weight = str(d.block_loss), d.temperature, d.kd_weight
        self.autotune = Autotune(d.autotune, student_blocks)
        self.converging = schedule.converging(d)
        self.canonical = str(config.training.reduction) == "canonical"  # apr/train/reduction.py
        self.progress = Progress(d, student_blocks)
        self.last_phase: tuple[int, int | None] = (0, None)
        self.started = False  # this step begins a phase-1 block or phase 2 (an event: apr/train/events.py)
        self.step = 0
        self.events: list[tuple[str, str, dict]] = []  # (kind, message, detail): each block's end, drained by the run
        self.cache_on = bool(d.cache_teacher_outputs)
        self.cache = None  # apr.train.teacher_cache.TeacherCache, made at the first phase-1 batch (its row length)
        self.boundaries = sorted({b for span in self.spans for b in span})
        # a narrower student: learned projections teacher -> student hidden (``down``) and back
        # (``up``), started from the teacher embedding's top singular directions; the loss's, not
        # the model's, so export never sees them (docs/design.md, "Upcycling into a new architecture")
        self.projections: dict[str, torch.nn.Parameter] = {}
        if student_hidden is not None and student_hidden != teacher.arch.hidden_size:
            basis = surgery.hidden_basis(teacher.model.embed_tokens.weight, student_hidden)
            self.projections = {PROJ_DOWN: torch.nn.Parameter(basis.T.contiguous()),
                                PROJ_UP: torch.nn.Parameter(basis.clone())}

    def extra_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Trained parameters of the loss itself (the projections of a narrower student), by their
        checkpoint names: the engine gives them their own optimizer group and moments."""
        return self.projections

    def begin_step(self, step: int) -> None:
        self.step = step
        if not self.converging:
            phase = schedule.phase_at(self.config, step)
            self.started = step == 1 or schedule.phase_at(self.config, step - 1) != phase
        else:
            phase = (2, None) if self.progress.done else (1, self.progress.block)
            self.started = phase != self.last_phase
        self.last_phase = phase

    def __call__(self, engine, lm: LlamaForCausalLM, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        phase, block = self.last_phase
        return self.block_loss_of(engine, lm, block, ids) if phase == 1 else self.kd_loss(engine, lm, ids, targets)

    def lr_factor(self, loss: torch.Tensor) -> float:
        phase, block = self.last_phase
        if phase != 1:
            return 1.0
        # every rank decides alike (a block's end, autotune's LR factor): fast averages the ranks' own
        # losses; canonical's is already the global batch's, the same bits on every rank and layout
        value = float(loss) if self.canonical else self._agreed(loss)
        self.autotune.observe(block, value)
        self._block_step(block, value)
        return self.autotune.factor[block]

    @staticmethod
    def _agreed(loss: torch.Tensor) -> float:
        """The step's loss averaged over data-parallel ranks: every rank ends a block at the same step."""
        if dist.is_available() and dist.is_initialized():
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return float(loss)

    def _block_step(self, block: int, loss: float) -> None:
        """Count the step against the block; where the block ends, an event with why and its last loss."""
        if self.converging:
            why = self.progress.observe(loss)
        else:
            if self.progress.block != block:  # a gated step left the count behind the schedule
                self.progress.block, self.progress.steps, self.progress.best, self.progress.since = block, 0, None, 0
            self.progress.observe(loss)
            why = "steps" if schedule.phase_at(self.config, self.step + 1) != (1, block) else None
        if why is None:
            return
        p = self.progress
        said = {"converged": lambda: f"converged (loss <= {p.target:g})",
                "stalled": lambda: f"stalled ({p.patience} steps without a new best)",
                "max_steps": lambda: f"reached its {p.max_steps} steps without converging",
                "steps": lambda: f"finished its {p.max_steps} steps"}[why]()
        after = "" if why == "steps" else f" after {p.steps} steps"
        self.events.append(("distill_block", f"phase 1: student block {block} {said} at step {self.step}{after}, "
                            f"final loss {loss:.4g}, best {p.best:.4g}",
                            {"block": block, "step": self.step, "steps": self.progress.steps, "reason": why,
                             "loss": loss, "best": self.progress.best}))
        self.progress.next_block()

    # ------------------------------------------------------------------------------ losses

    def block_loss_of(self, engine, lm: LlamaForCausalLM, block: int, ids: torch.Tensor) -> torch.Tensor:
        """Phase 1 loss of student block ``block`` on a batch of ids."""
        start, end = self.spans[block]
        if self.cache_on:
            states = self._cached_states(ids)
            h_in, target = states[self.boundaries.index(start)], states[self.boundaries.index(end)]
        else:
            h_in, target = self._teacher_states(ids, (start, end))
        if self.projections:  # a narrower student: into its hidden size, and its output back
            h_in = F.linear(h_in, self.projections[PROJ_DOWN])
        s_cos, s_sin = lm.rope(ids.shape[1], ids.device)
        with engine.autocast():
            out = lm.model.layers[block](h_in, s_cos, s_sin)
        out = out.float()
        if self.projections:
            out = F.linear(out, self.projections[PROJ_UP])
        if self.block_loss == "cosine":
            return (1.0 - F.cosine_similarity(out, target, dim=-1)).mean()
        return F.l1_loss(out, target) if self.block_loss == "l1" else F.mse_loss(out, target)

    @torch.no_grad()
    def _teacher_states(self, ids: torch.Tensor, boundaries) -> torch.Tensor:
        """The teacher's hidden states at the inputs of its blocks ``boundaries`` (sorted; the last may
        be its depth: the last block's output), stacked."""
        t = self.teacher
        cos, sin = t.rope(ids.shape[1], ids.device)
        x, out = t.model.embed_tokens(ids), []
        for j in range(boundaries[-1] + 1):
            if j in boundaries:
                out.append(x)
            if j < boundaries[-1]:
                x = t.model.layers[j](x, cos, sin)
        return torch.stack(out)

    def _cached_states(self, ids: torch.Tensor) -> torch.Tensor:
        """All boundaries' teacher states for ``ids``: from the cache, else computed and cached
        (design section 33)."""
        if self.cache is None:
            from apr.train.teacher_cache import TeacherCache, default_cache_dir, teacher_digest

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self.cache = TeacherCache(default_cache_dir(), teacher_digest(self.teacher), self.boundaries,
                                      ids.shape[1], self.teacher.arch.hidden_size, rank, self._cache_warning)
        states = self.cache.get(ids)
        if states is None:
            states = self._teacher_states(ids, self.boundaries)
            self.cache.put(ids, states)
        return states

    def _cache_warning(self, message: str) -> None:
        self.events.append(("teacher_cache", message, {"step": self.step}))

    def kd_loss(self, engine, lm: LlamaForCausalLM, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Phase 2: KD to the teacher's logits mixed with the LM loss."""
        with engine.autocast():
            h = lm.model.norm(engine.hidden_states(lm, ids))
            logits = F.linear(h, lm.head_weight)
        logits = logits.float()
        with torch.no_grad():
            teacher_logits = self.teacher(ids)
        vocab = logits.shape[-1]
        ce = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        if self.kd_weight == 0.0:
            return ce
        temp = self.temperature
        kl = F.kl_div(F.log_softmax(logits.reshape(-1, vocab) / temp, dim=-1),
                      F.log_softmax(teacher_logits.reshape(-1, vocab) / temp, dim=-1),
                      log_target=True, reduction="batchmean")
        return self.kd_weight * temp * temp * kl + (1.0 - self.kd_weight) * ce

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"autotune": self.autotune.state_dict(), "phase1": self.progress.state_dict(),
                "distill_phase": list(self.last_phase)}

    def load_state_dict(self, meta: dict | None) -> None:
        meta = meta or {}
        self.autotune.load_state_dict(meta.get("autotune"))
        self.progress.load_state_dict(meta.get("phase1"))
        if meta.get("distill_phase"):
            self.last_phase = (int(meta["distill_phase"][0]), meta["distill_phase"][1])


def distill_loss(config: AprConfig, student: LlamaForCausalLM, device: torch.device) -> DistillLoss:
    """The teacher loaded (and, with ``init_from_teacher``, the student initialised from it) and the
    loss part over it."""
    teacher = load_teacher(config, device)
    d = config.training.distill
    spans = schedule.spans(student.arch.num_hidden_layers, teacher.arch.num_hidden_layers, d.block_map)
    if d.init_from_teacher:
        init_student_from_teacher(student, teacher, spans)
    loss = DistillLoss(config, teacher, student.arch.num_hidden_layers, student.arch.hidden_size)
    for p in loss.projections.values():
        p.data = p.data.to(device)
    return loss
