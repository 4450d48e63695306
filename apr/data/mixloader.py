"""A loader that draws each row from one of several named sources (issue 21, item 1).

Which source each row comes from follows ``apr.data.mixplan``'s stages and
``apr.data.mixture.MixtureCursor``'s deterministic schedule, so the run draws exactly what
``mixplan.account`` / ``mixplan.replay`` planned. A draw ``(source, epoch, position)`` reads row
``perm[position]`` of that source, where ``perm`` is the source's permutation for ``epoch``
seeded by ``(seed, source index, epoch)`` (stored order without shuffle). A global micro-batch is
``batch_size x world_size`` consecutive draws and rank ``r`` takes its slice, as in ShardLoader.
The state (stage, schedule credit and every source's cursor) round-trips through
``state_dict``/``load_state_dict``, so a resumed loader continues each source at its exact row.
Not yet built by the run loop (apr/train/run.py still uses one ShardLoader).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from apr.data.loader import ShardLoader
from apr.data.mixplan import Stage, _stage_cursor, stage_starts
from apr.data.mixture import MixtureCursor, MixtureError

STATE_VERSION = 1


class MixtureLoader:
    def __init__(self, sources: dict[str, str | Path], stages: list[Stage], *, total_steps: int, seq_len: int,
                 batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1, gradient_accumulation: int = 1,
                 shuffle: bool = True, **loader_options):
        self.names = list(sources)
        self.loaders = {n: ShardLoader(p, seq_len=seq_len, batch_size=batch_size, seed=seed, rank=rank,
                                       world_size=world_size, gradient_accumulation=gradient_accumulation,
                                       shuffle=shuffle, **loader_options) for n, p in sources.items()}
        self.rows = {n: ld.num_rows for n, ld in self.loaders.items()}
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.stages = stages
        self.rows_per_step = batch_size * world_size * gradient_accumulation
        self.stage_draws = [s * self.rows_per_step for s in stage_starts(stages, total_steps)]
        self.stage = 0
        self.cursor: MixtureCursor = _stage_cursor(None, stages[0], self.rows, seed)
        self.rows_seen = dict.fromkeys(self.names, 0)  # global draws per source (every rank's rows)
        self.last_rows: list[tuple[str, int]] = []  # this rank's last batch: (source, row index)
        self._perms: dict[tuple[str, int], np.ndarray] = {}

    @property
    def tokens_seen(self) -> dict[str, int]:
        """Training tokens drawn from each source so far (seq_len per row), over all ranks."""
        return {n: c * self.seq_len for n, c in self.rows_seen.items()}

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
        self.rows_seen[name] += 1
        return name, int(self._perm(name, epoch)[pos])

    def next_batch(self):
        """This rank's next ``[batch_size, seq_len + 1]`` int64 tensor."""
        import torch

        draws = [self._draw() for _ in range(self.batch_size * self.world_size)]
        mine = draws[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        self.last_rows = mine
        parts = [self.loaders[n]._gather(np.array([i])) for n, i in mine]
        return torch.cat(parts)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "stage": self.stage, "cursor": self.cursor.state(),
                "rows_seen": dict(self.rows_seen), "rows": dict(self.rows), "seed": self.seed,
                "rows_per_step": self.rows_per_step, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("rows", "seed", "rows_per_step", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise MixtureError(f"the saved mixture cursor does not fit this loader: {key} was "
                                   f"{state.get(key)!r}, now {getattr(self, key)!r}")
        self.stage = int(state["stage"])
        weights = {n: self.stages[self.stage].weights.get(n, 0.0) for n in self.rows}
        self.cursor = MixtureCursor.from_state(weights, self.rows, state["cursor"])
        self.rows_seen = {n: int(state["rows_seen"][n]) for n in self.names}
