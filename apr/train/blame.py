"""Each training row's loss at logged steps, for ``apr runs blame`` (docs/runs.md, "Blame").

Every step runs inside ``capture_row_losses`` (apr/kernels/linear_ce.py): every head walk adds its
rows' summed cross-entropy, a ``[batch]`` device tensor, from the per-position losses the backend
computes for the sum anyway (nothing is read to the host). Every step, since the run may stop after
any of them (a signal, an early stop, an alert, a steered ``stop_at``) and the step it stops at is
logged: a log step's rows are recorded right after it (``record``), another step's are held until
the next step, and recorded if the run stops there (``record_stopping``). The last
``gradient_accumulation`` of a step's tensors are its micro-batches (a norm pre-pass walks the head
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
        self._held: tuple[int, list[torch.Tensor], int] | None = None  # (step, rows, first micro-batch)

    def capture(self, step: int):
        """The context to run step ``step`` in: every step's rows are captured (device tensors only)."""
        self._captured, self._held = None, None
        return self._capturing()

    @contextlib.contextmanager
    def _capturing(self):
        with capture_row_losses() as captured:
            yield
        self._captured = captured

    def record(self, step: int, recorder) -> None:
        """Right after step ``step``: its rows to the recorder when the cadence logs it; otherwise
        held for ``record_stopping``. Every rank takes part in the one all-reduce of a DDP run (the
        cadence is the same on every rank)."""
        captured, self._captured = self._captured, None
        if captured is None:
            return
        self._held = (step, captured, self.loader.absolute - self.accumulation)
        if self.cadence.log(step, stopping=False):
            self.record_stopping(step, recorder)

    def record_stopping(self, step: int, recorder, stopping: bool = True) -> None:
        """When the run stops after ``step`` (``stopping``, the same on every rank): the held rows of
        that step to the recorder (nothing when they were recorded already); on every rank, as
        ``record``."""
        held, self._held = (self._held, None) if stopping else (None, self._held)
        if held is None or held[0] != step:
            return
        _, captured, first = held
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
        recorder.log_row_losses(step, self.rows(losses.detach().float().cpu().tolist(), first))

    def rows(self, losses: list[list[float]], first: int) -> list[dict]:
        """One entry per row of the step's micro-batches (every rank's, in rank order; the first of
        them the global micro-batch ``first``), the loss per token."""
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
