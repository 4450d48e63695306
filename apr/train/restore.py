"""One restore service: the run put back at a saved state (issue 46; docs/design.md, "The run loop").

A resume, ``training.rollback`` (apr/train/survive.py) and the orchestrator's branches and safety
rollback (apr/train/orchestrator.py) all go through ``restore(run, source)``, so every path puts
back the same fields the same way:

- the engine of the state's stacking stage (rebuilt when the run is at another stage's depth), then
  its weights and optimizer moments (a sharded ``Snapshot``: each rank its own rows);
- every registered stateful part of the run (apr/train/stateful.py, in registration order): the data
  cursor, the RNGs, the engine's meta (optimizer step counts, loss scale), validation, early
  stopping, survival, steering, the orchestrator, ... except the parts the caller ``keep``s as they
  are now (a safety rollback keeps the data cursor past the bad window and the orchestrator's own
  decisions);
- the step: the state's step is the last finished one (``Run.move_to``).

The source is a checkpoint read from disk (``Saved``: under DDP every rank has finished reading it
before ``restore`` returns, so rank 0 may rewrite that step's files) or a state held in memory
(``Snapshot``: the engine's tensors cloned and every part's metadata deep-copied, as a checkpoint
holds them). What the restore means for the records (``recorder.rewind``) and for the rest of the
run (a window to skip, a strategy to switch to) stays with the caller: its order against the
checkpoint that records the decision is what makes a kill at any point resume into the same run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from apr.checkpoint.manager import TrainState
from apr.steps import stacking


class Source(Protocol):
    """A saved state: its step (the last finished one), its tensors, its parts' metadata."""

    @property
    def step(self) -> int: ...

    def load_tensors(self, engine) -> None: ...
    def meta(self) -> dict: ...


@dataclass(frozen=True)
class Saved:
    """A checkpoint of the run read from disk (``Checkpoints.load``: on shards, this rank's rows)."""

    state: TrainState
    path: Path

    @property
    def step(self) -> int:
        return int(self.state.step)

    def load_tensors(self, engine) -> None:
        engine.load_train_state_tensors(self.state.tensors)

    def meta(self) -> dict:
        return self.state.meta


@dataclass(frozen=True)
class Snapshot:
    """The run's exact state in memory: what a checkpoint of ``step`` would hold."""

    step: int
    local: bool  # a sharded engine's own rows (nothing gathered); each rank restores its own
    tensors: dict[str, torch.Tensor]
    state: dict  # the registered parts' metadata (copied again at each restore: a snapshot is reused)

    @classmethod
    def take(cls, run) -> Snapshot:
        run.engine.check_finite()
        local = bool(run.engine.sharded)
        tensors = run.engine.local_state_tensors() if local else run.engine.train_state_tensors(everywhere=True)
        return cls(run.step, local, {k: v.detach().clone() for k, v in tensors.items()},
                   copy.deepcopy(run.registry.state_dict()))

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Snapshot:
        """The same state with these tensors in place of its own (a nowcast's weights)."""
        return replace(self, tensors=tensors)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.tensors.items() if not n.startswith("optimizer.")}

    def load_tensors(self, engine) -> None:
        (engine.load_local_state_tensors if self.local else engine.load_train_state_tensors)(self.tensors)

    def meta(self) -> dict:
        return copy.deepcopy(self.state)


def restore(run, source: Source, *, keep: tuple[str, ...] = (), force: bool = False) -> int:
    """Put ``run`` back at ``source``'s state, all but the stateful parts named in ``keep``; returns
    the restored step. ``force``: a forced resume may re-map a data cursor of another layout."""
    step = source.step
    if stacking.stage_at(run.config, step) != run.stack_stage:  # another stacking stage's depth
        run.rebuild_engine(step)
    source.load_tensors(run.engine)
    run.force_cursor = force
    run.registry.load_state_dict(source.meta(), skip=keep)
    if isinstance(source, Saved) and run.dp is not None:
        run.dp.barrier()  # every rank has read the files before rank 0 writes this step again
    run.move_to(step)
    return step
