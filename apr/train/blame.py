"""Each training row's loss at logged steps, for ``apr runs blame`` (docs/runs.md, "Blame").

At a step the cadence logs, the step runs inside ``capture_row_losses`` (apr/kernels/linear_ce.py):
every head walk adds its rows' summed cross-entropy, a ``[batch]`` device tensor. After the step the
last ``gradient_accumulation`` of them are the step's micro-batches (a norm pre-pass walks the head
twice over the same batch: its last walk is the step's); under DDP the ranks' rows are summed into
one ``[world, accum, batch]`` tensor (each rank fills its own slot), so the record covers every
rank's rows. Each row gets its global micro-batch, its index into the data, its source, shard and
row (the loader's ``rows_at``/``locate``, as the bad-batch ledger), and its mean loss per token;
rank 0 records them in the local store's ``row_losses`` table. An engine whose loss never walks the
LM head (distillation's block phases) captures nothing: such steps have no record.
"""

from __future__ import annotations

import contextlib

import torch

from apr.kernels.linear_ce import capture_row_losses


class RowBlame:
    """Captures and records the per-row losses of the logged steps of one run."""

    def __init__(self, cadence, loader, *, seq_len: int, accumulation: int, mixture: bool, dp=None):
        self.cadence, self.loader, self.dp = cadence, loader, dp
        self.seq_len, self.accumulation, self.mixture = seq_len, accumulation, mixture
        self._captured: list[torch.Tensor] | None = None

    def capture(self, step: int):
        """The context to run step ``step`` in: capturing at a log step, nothing otherwise (a run that
        stops at a step between log steps logs it too, without row losses)."""
        if not self.cadence.log(step, stopping=False):
            self._captured = None
            return contextlib.nullcontext()
        return self._capturing()

    @contextlib.contextmanager
    def _capturing(self):
        with capture_row_losses() as captured:
            yield
        self._captured = captured

    def record(self, step: int, recorder) -> None:
        """The captured rows of ``step``, located in the data, to the recorder; every rank takes part
        in the one all-reduce of a DDP run (the cadence is the same on every rank)."""
        captured, self._captured = self._captured, None
        if captured is None:
            return
        accum = self.accumulation
        losses = torch.stack(captured[-accum:]) if len(captured) >= accum else None
        if self.dp is not None:  # one all-reduce: each rank fills its slot, and its last cell says it did
            world, rank, size = self.dp.world_size, self.dp.rank, self.loader.batch_size
            device = losses.device if losses is not None else self.dp._device()
            gathered = torch.zeros((world, accum * size + 1), dtype=torch.float32, device=device)
            if losses is not None and tuple(losses.shape) == (accum, size):
                gathered[rank, :-1] = losses.reshape(-1)
                gathered[rank, -1] = 1.0
            self.dp.sum_(gathered)
            gathered = gathered.cpu()
            if int(gathered[:, -1].sum().item()) != world:
                return  # a rank without its rows: the step gets no record on any rank
            losses = gathered[:, :-1].reshape(world, accum, size).permute(1, 0, 2).reshape(accum, world * size)
        elif losses is None:
            return
        recorder.log_row_losses(step, self.rows(losses.detach().float().cpu().tolist()))

    def rows(self, losses: list[list[float]]) -> list[dict]:
        """One entry per row of the step's micro-batches (every rank's, in rank order), the loss per token."""
        first = self.loader.absolute - self.accumulation
        out = []
        for k, micro in enumerate(losses):
            indices = self.loader.rows_at(first + k)
            for index, loss in zip(indices, micro, strict=False):
                shard, row = self.loader.locate(index)
                source = None  # one source: data.train, in the run's params (the table stays compact)
                if self.mixture:  # a mixture's shard is "<source>/<shard file>"
                    source, _, shard = shard.partition("/")
                out.append({"micro_batch": first + k, "index": index, "source": source, "shard": shard,
                            "row": row, "loss": loss / self.seq_len})
        return out


def row_blame(run) -> RowBlame:
    """The run's ``RowBlame`` (``run``: apr.train.run.Run, after its data side is set up)."""
    config = run.config
    return RowBlame(run.cadence, run.loader, seq_len=config.data.seq_len,
                    accumulation=config.training.gradient_accumulation,
                    mixture=bool(run.mixture), dp=run.dp)
