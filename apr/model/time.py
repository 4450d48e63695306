"""Time conditioning (``model.architecture.time``; StackWise's time-as-input and time-as-depth).

Each sequence has a time step ``s`` in ``[0, num_time_steps)``. Its encoding (sines and cosines of
``s``, or row ``s`` of a learned table) goes through a learned ``embedding_dim x hidden_size``
projection and is added to every position's token embedding: ``TimedEmbedding`` is the token
embedding (HF's ``model.embed_tokens``) with that sum in its forward, so every path that embeds
tokens (the engine's, recompute, validation, generation with or without the KV cache) conditions on
time. The time module itself is ``model.time_embedding`` (``table.weight`` for learned,
``proj.weight``), in the embedding's optimizer group (apr/model/spec.py ``time_param_specs``).

Which step a forward uses: the per-row steps ``conditioned`` sets (training), else the model's
``fixed_step`` (validation, apr eval, apr generate): ``eval_time``'s step for interpretation input,
the stage's step for depth (``fixed_step_of``).
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager

import torch
import torch.nn as nn

from apr.config.schema import AprConfig, Architecture
from apr.model.timesteps import DEFAULT_EVAL_TIME, fixed_step_of, step_of


def row_steps(rows: torch.Tensor, n: int, seed: int, step: int) -> torch.Tensor:
    """Time-as-input: each row's step (int64, CPU), from ``t`` uniform in ``[0, 1]`` drawn by a generator
    seeded by the run's seed, the optimizer step and the row's own tokens, so a row's time depends on
    neither its micro-batch nor its rank nor the process that resumes it (bitwise resume)."""
    if type(rows) is not torch.Tensor:  # fake tensors (apr train plan --trace): no tokens to read, any step
        return torch.zeros(rows.shape[0], dtype=torch.int64)
    cpu = rows.detach().to("cpu", torch.int64).contiguous()
    out = torch.empty(cpu.shape[0], dtype=torch.int64)
    for i, row in enumerate(cpu):
        digest = zlib.crc32(row.numpy().tobytes(), 0x7153)  # another stream than the masked LM's masks
        gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 4_294_967_311 + digest) % 2**63)
        out[i] = step_of(float(torch.rand(1, generator=gen, dtype=torch.float64)), n)
    return out


class TimeEmbedding(nn.Module):
    """A step per row -> ``[rows, hidden_size]``: the encoding, then the projection."""

    def __init__(self, arch: Architecture):
        super().__init__()
        t = arch.time
        self.num_time_steps, self.dim = t.num_time_steps, t.embedding_dim
        self.table = nn.Embedding(t.num_time_steps, t.embedding_dim) if str(t.encoding) == "learned" else None
        self.proj = nn.Linear(t.embedding_dim, arch.hidden_size, bias=False)
        self.fixed_step = 0 if str(t.interpretation) == "depth" else step_of(
            DEFAULT_EVAL_TIME if t.eval_time is None else t.eval_time, t.num_time_steps)
        self.row_steps: torch.Tensor | None = None  # the forward in progress's, set by ``conditioned``

    def encode(self, steps: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table(steps)
        half = self.dim // 2  # the transformer's position encoding, of the step
        freqs = torch.exp(torch.arange(half, device=steps.device, dtype=torch.float32) * (-math.log(10000.0) / half))
        angles = steps.to(torch.float32)[:, None] * freqs[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    def forward(self, steps: torch.Tensor) -> torch.Tensor:
        return self.proj(self.encode(steps).to(self.proj.weight.dtype))

    def added(self, embedded: torch.Tensor) -> torch.Tensor:
        """``embedded`` (``[rows, seq, hidden]``) plus each row's time embedding."""
        steps = self.row_steps
        if steps is None:
            steps = torch.full((embedded.shape[0],), self.fixed_step, dtype=torch.int64)
        return embedded + self(steps.to(embedded.device))[:, None, :].to(embedded.dtype)


class TimedEmbedding(nn.Embedding):
    """The token embedding plus the row's time embedding (``time``: the model's ``time_embedding``,
    held without registering it here, so parameter names stay HF's)."""

    def __init__(self, vocab_size: int, hidden_size: int, time: TimeEmbedding):
        super().__init__(vocab_size, hidden_size)
        object.__setattr__(self, "time", time)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.time.added(super().forward(ids))


@contextmanager
def conditioned(lm, steps: torch.Tensor | None):
    """Forwards of ``lm`` inside run each row at ``steps`` (None: the model's fixed step)."""
    module = lm.model.time_embedding
    module.row_steps = steps
    try:
        yield
    finally:
        module.row_steps = None


def set_fixed_step(lm, config: AprConfig) -> None:
    """The step ``lm`` runs at outside training, from ``config`` (``fixed_step_of``)."""
    if config.model.architecture.time is not None:
        lm.model.time_embedding.fixed_step = fixed_step_of(config)
