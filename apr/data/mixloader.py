"""A loader that draws each row from one of several named sources (a data mixture).

Which source each row comes from follows ``apr.data.mixplan``'s stages and
``apr.data.mixture.MixtureCursor``'s deterministic schedule, so the run draws exactly what
``mixplan.account`` / ``mixplan.replay`` planned. A draw ``(source, epoch, position)`` reads row
``perm[position]`` of that source, where ``perm`` is the source's permutation for ``epoch``
seeded by ``(seed, source index, epoch)`` (stored order without shuffle). A global micro-batch is
``batch_size x world_size`` consecutive draws and rank ``r`` takes its slice, as in ShardLoader.

It offers the ShardLoader interface the run loop uses (``absolute``/``seek`` for rollbacks and
rewinds, ``rows_at``/``locate`` for the bad-batch ledger, ``epoch``/``position`` over the mixture's
virtual epoch of ``num_rows`` = every source's rows). The state (stage, schedule credit, every
source's cursor, rows drawn per source) round-trips through ``state_dict``/``load_state_dict``, so a
resumed loader continues each source at its exact row. See docs/design.md, "Data mixtures".
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

import numpy as np

from apr.data.loader import ShardLoader
from apr.data.mixplan import Stage, _stage_cursor, stage_starts
from apr.data.mixture import MixtureCursor, MixtureError
from apr.errors import AprError, Finding
from apr.steps.algebra import step_count

STATE_VERSION = 2
_KEEP = 256  # micro-batches whose draws and cursor states are kept for rewinds and the ledger


class MixtureLoader:
    def __init__(self, sources: dict[str, str | Path], stages: list[Stage], *, total_steps: int | None, seq_len: int,
                 batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1, gradient_accumulation: int = 1,
                 shuffle: bool = True, repeat: bool = True, **loader_options):
        self.names = list(sources)
        self.loaders = {n: ShardLoader(p, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=rank,
                                       world_size=world_size, gradient_accumulation=gradient_accumulation,
                                       shuffle=shuffle, **loader_options) for n, p in sources.items()}
        self.rows = {n: ld.num_rows for n, ld in self.loaders.items()}
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.rank, self.world_size, self.gradient_accumulation = rank, world_size, gradient_accumulation
        self.repeat = repeat
        self.stages = stages
        self.num_rows = sum(self.rows.values())  # a mixture's epoch: as many rows as all its sources hold
        count = step_count(num_sequences=self.num_rows, batch_size=batch_size,
                           gradient_accumulation=gradient_accumulation, world_size=world_size)
        self.sequences_per_step, self.steps_per_epoch = count.sequences_per_step, count.steps_per_epoch
        self.micro_batches_per_epoch = self.steps_per_epoch * gradient_accumulation
        self.rows_per_step = batch_size * world_size * gradient_accumulation
        self.rows_per_micro = batch_size * world_size
        self.stage_draws: list[int] = [0]
        if total_steps is not None:
            self.set_total_steps(total_steps)
        self._reset()
        self._perms: dict[tuple[str, int], np.ndarray] = {}

    def set_total_steps(self, total_steps: int) -> None:
        """The run's length, which places the stages (a fraction start is a fraction of it)."""
        self.stage_draws = [s * self.rows_per_step for s in stage_starts(self.stages, total_steps)]

    def _reset(self) -> None:
        self.stage = 0
        self.cursor: MixtureCursor = _stage_cursor(None, self.stages[0], self.rows, self.seed)
        self.rows_seen = dict.fromkeys(self.names, 0)  # global draws per source (every rank's rows)
        self.last_rows: list[tuple[str, int]] = []  # this rank's last batch: (source, row index)
        self._recent: OrderedDict[int, list[tuple[str, int]]] = OrderedDict()  # micro-batch -> global draws
        self._states: OrderedDict[int, dict] = OrderedDict()  # micro-batch -> state before it

    # ------------------------------------------------------------------------------ figures

    @property
    def tokens_seen(self) -> dict[str, int]:
        """Training tokens drawn from each source so far (seq_len per row), over all ranks."""
        return {n: c * self.seq_len for n, c in self.rows_seen.items()}

    @property
    def source_epochs(self) -> dict[str, float]:
        """Epochs of each source read so far (rows drawn / rows held)."""
        return {n: self.rows_seen[n] / self.rows[n] for n in self.names}

    @property
    def stage_name(self) -> str:
        return self.stages[self.stage].name or f"stage{self.stage}"

    def figures(self) -> dict:
        """What the records show: the stage and, per source, tokens, rows and epochs so far."""
        return {"stage": self.stage, "stage_name": self.stage_name,
                "sources": {n: {"tokens": self.rows_seen[n] * self.seq_len, "rows": self.rows_seen[n],
                                "epochs": self.rows_seen[n] / self.rows[n]} for n in self.names}}

    # ------------------------------------------------------------------------------ the cursor as one number

    @property
    def absolute(self) -> int:
        """Micro-batches drawn since the start of the run, counted globally."""
        return self.cursor.draws // self.rows_per_micro

    @property
    def epoch(self) -> int:
        return self.absolute // max(self.micro_batches_per_epoch, 1)

    @property
    def position(self) -> int:
        return self.absolute % max(self.micro_batches_per_epoch, 1)

    def seek(self, absolute: int) -> None:
        """Put the cursor at micro-batch ``absolute``: forward by drawing without reading rows;
        backward from a kept state (the last ``_KEEP`` micro-batches) or by replaying from the start."""
        absolute = int(absolute)
        if absolute < self.absolute:
            kept = self._states.get(absolute)
            if kept is not None:
                self._load(copy.deepcopy(kept))
            else:
                self._reset()
        while self.absolute < absolute:
            self._advance_micro(read=False)

    def draws_at(self, absolute: int) -> list[tuple[str, int]]:
        """The (source, row) draws of global micro-batch ``absolute`` (already drawn), every rank's
        part in rank order; an old one is replayed as in ``rows_at``."""
        offsets = self._offsets()
        out = []
        for index in self.rows_at(absolute):
            name = max((n for n in self.names if offsets[n] <= index), key=lambda n: offsets[n])
            out.append((name, index - offsets[name]))
        return out

    def rows_at(self, absolute: int) -> list[int]:
        """The rows of global micro-batch ``absolute`` (already drawn), every rank's part, as indices
        into the sources laid end to end in config order (see ``locate``). The last ``_KEEP`` are kept;
        an older one is found by replaying the schedule, the cursor left where it was."""
        absolute = int(absolute)
        draws = self._recent.get(absolute)
        if draws is None:  # older than the kept window: replay to it, then back to where the cursor was
            if not 0 <= absolute < self.absolute:
                raise MixtureError(f"micro-batch {absolute} has not been drawn (the cursor is at {self.absolute})")
            here = self.absolute
            self.seek(absolute)
            self._advance_micro(read=False)
            draws = self._recent[absolute]
            self.seek(here)
        offsets = self._offsets()
        return [offsets[n] + i for n, i in draws]

    def locate(self, index: int) -> tuple[str, int]:
        """(``source/shard file``, row within that shard) of a ``rows_at`` index."""
        for name, start in reversed(list(self._offsets().items())):
            if index >= start:
                shard, row = self.loaders[name].locate(index - start)
                return f"{name}/{shard}", row
        raise IndexError(index)

    def _offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for n in self.names:
            out[n], at = at, at + self.rows[n]
        return out

    # ------------------------------------------------------------------------------ drawing

    def _perm(self, name: str, epoch: int) -> np.ndarray:
        key = (name, epoch)
        if key not in self._perms:
            n = self.rows[name]
            if self.shuffle:
                rng = np.random.default_rng([self.seed % 2**64, self.names.index(name), epoch])
                perm = rng.permutation(n)
            else:
                perm = np.arange(n)
            self._perms = {k: v for k, v in self._perms.items() if k[0] != name}  # one epoch per source kept
            self._perms[key] = perm
        return self._perms[key]

    def _draw(self) -> tuple[str, int]:
        while self.stage + 1 < len(self.stages) and self.cursor.draws >= self.stage_draws[self.stage + 1]:
            self.stage += 1
            self.cursor = _stage_cursor(self.cursor, self.stages[self.stage], self.rows, self.seed)
        name, epoch, pos = self.cursor.next()
        if epoch > 0 and not self.repeat:
            raise AprError(f"data source {name!r} is exhausted: its {self.rows[name]} rows are all read and "
                           "data.repeat is false", [Finding(
                               "error", "data.exhausted", f"source {name!r} read to its end", path="data.repeat",
                               expected="a run the sources can supply (see `apr train plan`)",
                               got=f"{self.rows_seen[name]} rows drawn from {name!r}")])
        self.rows_seen[name] += 1
        return name, int(self._perm(name, epoch)[pos])

    def _advance_micro(self, read: bool):
        at = self.absolute
        self._states[at] = self._save()
        draws = [self._draw() for _ in range(self.rows_per_micro)]
        self._recent[at] = draws
        while len(self._states) > _KEEP:
            self._states.popitem(last=False)
        while len(self._recent) > _KEEP:
            self._recent.popitem(last=False)
        mine = draws[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.last_rows = mine
        if not read:
            return None
        import torch

        return torch.cat([self.loaders[n]._gather(np.array([i])) for n, i in mine])

    def next_batch(self):
        """This rank's next ``[batch_size, seq_len + 1]`` int64 tensor."""
        return self._advance_micro(read=True)

    # ------------------------------------------------------------------------------ state

    def _save(self) -> dict:
        return {"stage": self.stage, "cursor": self.cursor.state(), "rows_seen": dict(self.rows_seen)}

    def _load(self, state: dict) -> None:
        self.stage = int(state["stage"])
        weights = {n: self.stages[self.stage].weights.get(n, 0.0) for n in self.rows}
        self.cursor = MixtureCursor.from_state(weights, self.rows, state["cursor"])
        self.rows_seen = {n: int(state["rows_seen"][n]) for n in self.names}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": "mixture", **self._save(), "rows": dict(self.rows),
                "seed": self.seed, "rows_per_step": self.rows_per_step, "batch_size": self.batch_size,
                "world_size": self.world_size, "gradient_accumulation": self.gradient_accumulation,
                "shuffle": self.shuffle, "stage_draws": list(self.stage_draws),
                "stage_weights": [dict(st.weights) for st in self.stages]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor; AprError when it was saved for other sources, another layout
        or another mixture."""
        if state.get("kind") != "mixture":
            raise _cursor_error("kind", state.get("kind", "a single data.train"), "mixture")
        for key in ("rows", "seed", "rows_per_step", "shuffle", "stage_draws", "stage_weights"):
            now = self.state_dict()[key]
            if state.get(key) != now:
                raise _cursor_error(key, state.get(key), now)
        self._recent.clear()
        self._states.clear()
        self._load(state)


def _cursor_error(key: str, was, now) -> MixtureError:
    return MixtureError(f"the saved mixture cursor does not fit this loader: {key} was {was!r}, now {now!r}", [Finding(
        "error", "data.cursor", f"saved {key} differs", path=key, expected=str(now), got=str(was))])
