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
import torch.nn.functional as F

from apr.checkpoint.hf_import import load_source_weights, source_architecture
from apr.config.schema import AprConfig
from apr.model import surgery
from apr.model.llama import LlamaForCausalLM, build_model
from apr.steps import distill as schedule


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
    the student has fewer)."""
    student.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
    student.model.norm.weight.copy_(teacher.model.norm.weight)
    if student.lm_head is not None:
        student.lm_head.weight.copy_(teacher.head_weight)
    for i, (start, _end) in enumerate(spans):
        surgery.init_block(student.model.layers[i], teacher.model.layers[start], student.arch, teacher.arch)


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
        return {"ema": self.ema, "best": self.best, "since": self.since, "factor": self.factor}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.ema, self.best = list(state["ema"]), list(state["best"])
            self.since, self.factor = [int(x) for x in state["since"]], [float(x) for x in state["factor"]]


class DistillLoss:
    """The distillation loss part (see the module docstring) for either autograd source: one
    process, DDP, or FSDP2 shards of the student (the teacher is whole on every rank)."""

    kind = "distill"
    per_param_steps = True  # phase 1 updates one block at a time: AdamW step counts differ

    def __init__(self, config: AprConfig, teacher: LlamaForCausalLM, student_blocks: int):
        self.config = config
        self.teacher = teacher
        d = config.training.distill
        self.spans = schedule.spans(student_blocks, teacher.arch.num_hidden_layers, d.block_map)
        self.block_loss, self.temperature, self.kd_weight = str(d.block_loss), d.temperature, d.kd_weight
        self.autotune = Autotune(d.autotune, student_blocks)
        self.last_phase: tuple[int, int | None] = (0, None)

    def begin_step(self, step: int) -> None:
        self.last_phase = schedule.phase_at(self.config, step)

    def __call__(self, engine, lm: LlamaForCausalLM, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        phase, block = self.last_phase
        return self.block_loss_of(engine, lm, block, ids) if phase == 1 else self.kd_loss(engine, lm, ids, targets)

    def lr_factor(self, loss: torch.Tensor) -> float:
        phase, block = self.last_phase
        if phase != 1:
            return 1.0
        self.autotune.observe(block, float(loss))
        return self.autotune.factor[block]

    # ------------------------------------------------------------------------------ losses

    def block_loss_of(self, engine, lm: LlamaForCausalLM, block: int, ids: torch.Tensor) -> torch.Tensor:
        """Phase 1 loss of student block ``block`` on a batch of ids."""
        start, end = self.spans[block]
        t = self.teacher
        cos, sin = t.rope(ids.shape[1], ids.device)
        with torch.no_grad():
            x = t.model.embed_tokens(ids)
            for j in range(end):
                if j == start:
                    h_in = x
                x = t.model.layers[j](x, cos, sin)
            target = x
        s_cos, s_sin = lm.rope(ids.shape[1], ids.device)
        with engine.autocast():
            out = lm.model.layers[block](h_in, s_cos, s_sin)
        out = out.float()
        if self.block_loss == "cosine":
            return (1.0 - F.cosine_similarity(out, target, dim=-1)).mean()
        return F.mse_loss(out, target)

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
        return {"autotune": self.autotune.state_dict()}

    def load_state_dict(self, meta: dict | None) -> None:
        self.autotune.load_state_dict((meta or {}).get("autotune"))


def distill_loss(config: AprConfig, student: LlamaForCausalLM, device: torch.device) -> DistillLoss:
    """The teacher loaded (and, with ``init_from_teacher``, the student initialised from it) and the
    loss part over it."""
    teacher = load_teacher(config, device)
    d = config.training.distill
    spans = schedule.spans(student.arch.num_hidden_layers, teacher.arch.num_hidden_layers, d.block_map)
    if d.init_from_teacher:
        init_student_from_teacher(student, teacher, spans)
    return DistillLoss(config, teacher, student.arch.num_hidden_layers)
